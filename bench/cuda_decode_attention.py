"""Decode attention on a GPU, the worker's way against alternatives built of the same libtorch
ops: one query per sequence over its paged KV blocks (SmolLM2-135M's 9 query heads sharing 3 KV
heads of 64, bf16, 16-token blocks), timed with CUDA events per call, and each alternative's
largest difference from the worker's way.

    python3 bench/cuda_decode_attention.py [batch ...]     (default: 32 256 1024; context 256)

Ways, each one layer's attention (worker/src/attention.rs); the worker's own decode path is now
the paged kernel (worker/cuda/paged_decode_attention.cu, not timed here), "worker" below is its
gathered path, which prefill chunks and `RIVULET_KERNELS_NO_CUDA_PAGED_ATTENTION=1` take:
  worker      gather whole blocks (index_select), SDPA on the strided view with an additive mask
  gather      the two gathers alone (what the worker's way pays before attending)
  contiguous  the gathers made contiguous in [batch, kv_heads, keys, dim] before SDPA
  matmul      the gathers, then scores, mask, softmax (f32) and values by batched matmuls
"""

import sys

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CONTEXT = 9, 3, 64, 16, 256
DEV, KIND = "cuda", torch.bfloat16


def setup(batch):
    blocks = CONTEXT // BLOCK
    pool = batch * blocks + 8
    key_cache = torch.randn(pool * BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=KIND)
    value_cache = torch.randn(pool * BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=KIND)
    # Each sequence's blocks scattered through the pool, as a running server's are.
    tables = torch.randperm(pool, device=DEV)[: batch * blocks].view(batch, blocks)
    context = torch.randint(CONTEXT // 2, CONTEXT + 1, (batch,), device=DEV)
    allowed = torch.arange(blocks * BLOCK, device=DEV).unsqueeze(0) < context.unsqueeze(1)
    bias = torch.zeros(allowed.shape, device=DEV, dtype=KIND).masked_fill(~allowed, float("-inf"))
    bias = bias.view(batch, 1, 1, -1)
    q = torch.randn(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, device=DEV, dtype=KIND)
    return q, key_cache, value_cache, tables.reshape(-1), bias


def gather(cache, flat_tables, batch):
    return (
        cache.view(-1, BLOCK * KV_HEADS * HEAD_DIM)
        .index_select(0, flat_tables)
        .view(batch, -1, KV_HEADS, HEAD_DIM)
        .transpose(1, 2)
    )


def ways(q, key_cache, value_cache, flat_tables, bias):
    batch = q.shape[0]
    scale = HEAD_DIM**-0.5

    def worker():
        k, v = gather(key_cache, flat_tables, batch), gather(value_cache, flat_tables, batch)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def gathers():
        return gather(key_cache, flat_tables, batch), gather(value_cache, flat_tables, batch)

    def contiguous():
        k = gather(key_cache, flat_tables, batch).contiguous()
        v = gather(value_cache, flat_tables, batch).contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def matmul():
        k, v = gather(key_cache, flat_tables, batch), gather(value_cache, flat_tables, batch)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias.float()
        return torch.matmul(scores.softmax(-1).to(KIND), v)

    return {"worker": worker, "gather": gathers, "contiguous": contiguous, "matmul": matmul}


def time_ms(fn, repeats=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main():
    batches = [int(b) for b in sys.argv[1:]] or [32, 256, 1024]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    with torch.no_grad():
        for batch in batches:
            inputs = setup(batch)
            candidates = ways(*inputs)
            reference = candidates["worker"]().float()
            for name, fn in candidates.items():
                ms = time_ms(fn)
                out = fn()
                diff = "" if name == "gather" else f"  max |diff| {(out.float() - reference).abs().max().item():.2e}"
                print(f"batch {batch:5d}  {name:10s} {ms * 1e3:8.1f} us per layer{diff}")


if __name__ == "__main__":
    main()
