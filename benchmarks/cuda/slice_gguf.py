"""Write a copy of a GGUF that keeps only its first N transformer blocks (tokenizer, embedding and every other
tensor kept, blocks as stored: Q4_1 / Q8_0 stay quantized). The default model (94 MB) is over the 64 MiB a GPU
machine's working tree may carry; a 2-block copy (~36 MB) carries the real tokenizer and the real GGUF block
formats there, so the suite's fixtures and the GGUF paths run on CUDA.

    python benchmarks/cuda/slice_gguf.py SRC.gguf DST.gguf --blocks 2
"""

from __future__ import annotations

import argparse
import re

import gguf
import numpy as np


def slice_gguf(src: str, dst: str, blocks: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            value = blocks
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= blocks:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        data = np.asarray(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, data.reshape(shape))
        else:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)  # bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args()
    slice_gguf(a.src, a.dst, a.blocks)
