"""Do the compiled CPU kernels' failed checks raise, or crash, on this host? Each call runs in its own process; its
exit code and message are printed, and the first crash runs again under gdb where the host has it (docs/cuda.md: on
the GPU image, checks whose message formats a value crashed, text-only ones raised). It also prints the C++ ABI torch
was built with and the compiler that builds the kernels here.

    PYTHONPATH=. python benchmarks/cuda/kernel_checks.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys

CASES = {
    "valid": "k.grouped_dense_gemm(x, w, off)",
    "text message (dtype)": "k.dense_gemm(x.bfloat16(), w[0])",
    "text message (offsets dtype)": "k.grouped_dense_gemm(x, w, off.int())",
    "value message (offsets start)": "k.grouped_dense_gemm(x, w, off.flip(0))",
    "value message (offsets decrease)": "k.grouped_dense_gemm(x, w, torch.tensor([0, 5, 3, *off[3:].tolist()]))",
    "value message, one thread": "torch.set_num_threads(1); k.grouped_dense_gemm(x, w, off.flip(0))",
}
SETUP = """
import torch
from ember.kernels import cpu_kernels
k = cpu_kernels()
g = torch.Generator().manual_seed(3)
counts = [0, 1, 2, 3, 4, 0, 5, 13, 70, 0]
w = torch.randn(len(counts), 150, 72, generator=g)
x = torch.randn(sum(counts), 72, generator=g)
off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
try:
    {call}
    print("no error")
except RuntimeError as e:
    print("RuntimeError:", str(e)[:80])
"""


def main() -> None:
    info = "import torch; print('torch', torch.__version__, 'CXX11 ABI', torch._C._GLIBCXX_USE_CXX11_ABI)"
    subprocess.run([sys.executable, "-c", info], check=False)
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print("gcc:", gcc, "| gdb:", shutil.which("gdb"))
    subprocess.run([sys.executable, "-c", "from ember.kernels import cpu_kernels; print(cpu_kernels())"], check=False)
    traced = False
    for name, call in CASES.items():
        code = SETUP.replace("{call}", call)
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                           timeout=300)
        print(f"{name}: exit {r.returncode}: {r.stdout.strip()[-100:]}", flush=True)
        if r.returncode < 0 and not traced and shutil.which("gdb"):
            traced = True
            t = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c", code],
                               capture_output=True, text=True, timeout=300)
            print("\n".join(line for line in t.stdout.splitlines() if line.startswith("#"))[:4000], flush=True)


if __name__ == "__main__":
    main()
