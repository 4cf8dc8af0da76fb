"""Cost of the compressed wire formats on one tensor (distributed/wire_format.py): bytes
against fp32 and bf16, relative L2 error, and encode/decode time on this machine's CPU (the
median of 5 reps; indicative only, not a GPU figure). Then a toy for error feedback: least
squares by SGD whose gradients travel int8, with and without feedback, against exact.

    python benchmarks/wire_format_cost.py
"""

import statistics
import time

import torch

from fullshard.distributed.wire_format import decode, encode, encode_with_feedback, wire_nbytes


def median_seconds(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wire_costs(n: int = 10_000_000) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "randn": torch.randn(n, generator=gen),
        "heavy-tailed": torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen)),
    }
    for name, x in inputs.items():
        for fmt, bs in [("bf16", 256), ("int8", 64), ("int8", 256), ("int8", 1024)]:
            buf = encode(x, fmt, block_size=bs)
            y = decode(buf, n, torch.float32, fmt, block_size=bs)
            nbytes = wire_nbytes(n, fmt, block_size=bs)
            assert nbytes == buf.numel()
            rel = float((y - x).norm() / x.norm())
            enc = median_seconds(lambda: encode(x, fmt, block_size=bs))  # noqa: B023
            dec = median_seconds(
                lambda: decode(buf, n, torch.float32, fmt, block_size=bs)  # noqa: B023
            )
            print(f"{name:12} {fmt} block={bs:5} bytes={nbytes:>9} vs fp32 {nbytes / (4 * n):.4f} "
                  f"vs bf16 {nbytes / (2 * n):.4f} rel L2 {rel:.2e} "
                  f"encode {enc * 1e3:.0f} ms decode {dec * 1e3:.0f} ms")


def error_feedback_toy(steps: int = 300, lr: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(512, 256, generator=gen)
    b = a @ torch.randn(256, generator=gen)

    def loss(w: torch.Tensor) -> float:
        return float(((a @ w - b) ** 2).mean())

    exact = torch.zeros(256)
    for _ in range(steps):
        exact -= lr * (a.T @ (a @ exact - b) / 512)
    for feedback in (False, True):
        w = torch.zeros(256)
        residual = None
        for _ in range(steps):
            grad = a.T @ (a @ w - b) / 512
            if feedback:
                buf, residual = encode_with_feedback(grad, residual, "int8", block_size=256)
            else:
                buf = encode(grad, "int8", block_size=256)
            w -= lr * decode(buf, 256, torch.float32, "int8", block_size=256)
        print(f"toy least squares, int8 gradients, feedback={feedback}: loss {loss(w):.4e} "
              f"(exact {loss(exact):.4e})")


if __name__ == "__main__":
    print(f"torch threads: {torch.get_num_threads()}")
    wire_costs()
    error_feedback_toy()
