// AMX tiles for the bf16 kernels (Intel Sapphire Rapids and later): the OS grants a process the tile state once
// (arch_prctl), and each thread loads a tile configuration (rows and bytes a row of each tile register) before its
// first tile instruction and releases the state after its last. Only compiled where the build machine has AMX
// (EMBER_AMX, avx512_util.h); has_amx() says whether this process may use it.
#pragma once
#include "avx512_util.h"

#ifdef EMBER_AMX
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace ember_amx {

// Asked once a process: XTILEDATA (state component 18) through ARCH_REQ_XCOMP_PERM (0x1023). Fails on a CPU or
// kernel without AMX, which then keeps the AVX512 path.
inline bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// palette 1: up to 8 tiles of at most 16 rows x 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tile t: rows[t] rows of colsb[t] bytes; loaded into the calling thread
inline void configure(const uint8_t* rows, const uint16_t* colsb, int tiles) {
  TileConfig cfg;
  for (int t = 0; t < tiles; ++t) {
    cfg.rows[t] = rows[t];
    cfg.colsb[t] = colsb[t];
  }
  _tile_loadconfig(&cfg);
}

}  // namespace ember_amx
#endif
