"""Where a CUDA decode step's time goes: the worker's libtorch op sequence (worker/src/model.rs,
attention.rs, rope.rs), replayed in PyTorch on random bf16 weights of SmolLM2-135M's shapes under
torch.profiler. Prints, per batch size, the step's wall time, its GPU busy time, the kernels it
launches, and the ops that take the host's time. The Rust worker issues the same ATen ops through
tch (minus Python's own per-call cost), so the counts and the host/GPU split carry over.

    python3 bench/cuda_step_profile.py [batch ...]     (default: 1 32 1024; context 256)
"""

import sys
import time

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 576, 9, 3, 64, 1536, 30, 49152
BLOCK, CONTEXT = 16, 256
DEV, KIND = "cuda", torch.bfloat16


def weights():
    def w(*shape):
        return torch.randn(*shape, device=DEV, dtype=KIND) * 0.02

    layers = [
        dict(
            attn_norm=torch.ones(HIDDEN, device=DEV, dtype=KIND),
            ffn_norm=torch.ones(HIDDEN, device=DEV, dtype=KIND),
            qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            o=w(HIDDEN, HEADS * HEAD_DIM),
            gate_up=w(2 * FFN, HIDDEN),
            down=w(HIDDEN, FFN),
        )
        for _ in range(LAYERS)
    ]
    return dict(layers=layers, embed=w(VOCAB, HIDDEN), norm=torch.ones(HIDDEN, device=DEV, dtype=KIND))


def step(model, caches, batch, cos_table, sin_table):
    blocks_per_seq = CONTEXT // BLOCK + 1
    # Host-built inputs, copied to the device as the worker does.
    ids = torch.full((batch,), 100, dtype=torch.int64).to(DEV)
    positions = torch.full((batch,), CONTEXT - 1, dtype=torch.int64).to(DEV)
    slots = (torch.arange(batch) * blocks_per_seq * BLOCK + CONTEXT - 1).to(DEV)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq).to(DEV)
    context = torch.full((batch,), CONTEXT, dtype=torch.int64).to(DEV)
    key_pos = torch.arange(blocks_per_seq * BLOCK, device=DEV)
    allowed = (key_pos.unsqueeze(0) < context.unsqueeze(1)).view(-1, 1, 1, blocks_per_seq * BLOCK)
    bias = torch.zeros(allowed.shape, device=DEV, dtype=KIND).masked_fill(~allowed, float("-inf"))
    flat_blocks = tables.reshape(-1)
    cos = cos_table.index_select(0, positions).unsqueeze(1).unsqueeze(3)
    sin = sin_table.index_select(0, positions).unsqueeze(1).unsqueeze(3)

    hidden = model["embed"].index_select(0, ids)
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer, (key_cache, value_cache) in zip(model["layers"], caches):
        normed = F.rms_norm(hidden, (HIDDEN,), layer["attn_norm"], 1e-5)
        qkv = F.linear(normed, layer["qkv"])
        pairs = qkv[:, : q_dim + kv_dim].view(batch, HEADS + KV_HEADS, HEAD_DIM).float().view(
            batch, HEADS + KV_HEADS, HEAD_DIM // 2, 2
        )
        partner = torch.stack([-pairs[..., 1], pairs[..., 0]], 3)
        rotated = torch.addcmul(pairs * cos, partner, sin).view(batch, HEADS + KV_HEADS, HEAD_DIM).to(KIND)
        q, k = rotated[:, :HEADS], rotated[:, HEADS:]
        v = qkv[:, q_dim + kv_dim :].view(batch, KV_HEADS, HEAD_DIM)
        key_cache.index_copy_(0, slots, k)
        value_cache.index_copy_(0, slots, v)

        def gather(cache):
            return (
                cache.view(-1, BLOCK * KV_HEADS * HEAD_DIM)
                .index_select(0, flat_blocks)
                .view(batch, blocks_per_seq * BLOCK, KV_HEADS, HEAD_DIM)
                .transpose(1, 2)
            )

        qg = q.reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        attended = F.scaled_dot_product_attention(qg, gather(key_cache), gather(value_cache), attn_mask=bias)
        hidden.addmm_(attended.reshape(batch, HEADS * HEAD_DIM), layer["o"].t())
        normed = F.rms_norm(hidden, (HIDDEN,), layer["ffn_norm"], 1e-5)
        gate, up = F.linear(normed, layer["gate_up"]).chunk(2, 1)
        hidden.addmm_(F.silu(gate) * up, layer["down"].t())
    normed = F.rms_norm(hidden, (HIDDEN,), model["norm"], 1e-5)
    logits = F.linear(normed, model["embed"]).float()
    return logits.argmax(-1).cpu()


def main():
    batches = [int(b) for b in sys.argv[1:]] or [1, 32, 1024]
    torch.manual_seed(0)
    model = weights()
    slots = max(batches) * (CONTEXT // BLOCK + 1) * BLOCK
    caches = [
        (
            torch.randn(slots, KV_HEADS, HEAD_DIM, device=DEV, dtype=KIND),
            torch.randn(slots, KV_HEADS, HEAD_DIM, device=DEV, dtype=KIND),
        )
        for _ in range(LAYERS)
    ]
    angles = torch.outer(torch.arange(4096.0), 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))).to(DEV)
    cos_table, sin_table = angles.cos(), angles.sin()
    print(torch.__version__, torch.cuda.get_device_name())
    with torch.no_grad():
        for batch in batches:
            for _ in range(3):
                step(model, caches, batch, cos_table, sin_table)
            torch.cuda.synchronize()
            start = time.perf_counter()
            runs = 10
            for _ in range(runs):
                step(model, caches, batch, cos_table, sin_table)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / runs * 1e3
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                step(model, caches, batch, cos_table, sin_table)
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"\n=== batch {batch} @ context {CONTEXT}: step {wall:.2f} ms wall (no profiler), "
                  f"{kernels} kernels, GPU busy {gpu_us / 1e3:.2f} ms")
            print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


if __name__ == "__main__":
    main()
