"""Start-up measurements that choose how the reference runtime runs on this machine.

Which of the exact formulations is fastest can depend on the machine, not the model: the MoE reading
its experts' float32 weights or their exact bf16 copies cast back per GEMM was 7% apart one way on an
AMD EPYC VM and 8-10% the other way on two Intel Xeon VMs (docs/benchmarks.md, rounds 7 and 8); fbgemm's
float16 copies beat both on an AVX512 AMD EPYC VM (round 10). They give the same numbers (the float16
copies to float32 rounding: the GEMM sums in another order), so the runtime times each here and keeps
the fastest, as cuDNN's benchmark mode does.
"""

from __future__ import annotations

import statistics
import time

import torch

# `--expert-dtype`'s choices: auto, or a name in `GptOssTarget.expert_storages` where the target has that storage
EXPERT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "amx")


def interleaved_times(calls: list, rounds: int, warm_up: int = 0) -> list[list[float]]:
    """Seconds of each call in each round, timed round-robin (every call once per round) so that load
    from other jobs hits them alike; the first `warm_up` rounds are not timed."""
    for _ in range(warm_up):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, record in zip(calls, times):
            start = time.perf_counter()
            call()
            record.append(time.perf_counter() - start)
    return times


def interleaved_medians(calls: list, rounds: int) -> list[float]:
    """Median seconds of each call over `interleaved_times`."""
    return [statistics.median(record) for record in interleaved_times(calls, rounds)]


@torch.inference_mode()
def time_expert_storages(target, batch: int, block: int, context: int = 200, rounds: int = 16,
                         warm_up: int = 3) -> dict[str, float]:
    """The time of an autoregressive step then a `block`-token verify at `batch` rows over a
    `context`-token history, per storage of `target.expert_storages`, relative to the first storage's:
    the median over `rounds` interleaved rounds of each round's ratio (paired, so that the machine's
    drift between rounds cancels: on a busy VM the medians of the two storages' own times picked
    the slower one in one of eight timings, the paired ratio never; docs/benchmarks.md, round 8), after
    `warm_up` untimed rounds (the first steps after loading ran 30-40% slower, both storages alike).
    The target reads its experts as before afterwards."""
    device, kept = target.device, target.expert_storage
    generator = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (batch, context), generator=generator, device=device)
    # each round's steps read fresh tokens (the same for every storage), which route to other experts, as
    # decoding's do: the same tokens every round would find their experts in cache, which decoding does not
    rounds_tokens = torch.randint(0, target.vocab_size, (warm_up + rounds, batch, block), generator=generator,
                                  device=device)
    positions = torch.arange(context + block, device=device).expand(batch, -1)
    cache = target.new_cache(batch, context + block)
    target(prompt, positions[:, :context], cache, [])

    def steps(storage: str):
        tokens = iter(rounds_tokens)

        def run():
            target.use_expert_storage(storage)
            step = next(tokens)
            for width in (1, block):
                target(step[:, :width], positions[:, context: context + width], cache, [])
        return run

    names = list(target.expert_storages)
    times = interleaved_times([steps(name) for name in names], rounds, warm_up)
    target.use_expert_storage(kept)
    return {name: statistics.median(t / first for t, first in zip(record, times[0]))
            for name, record in zip(names, times)}


def choose_expert_storage(target, choice: str, batch: int, block: int) -> dict[str, float] | None:
    """`dflash-run --expert-dtype`: make `target` read its experts from the storage `choice` names, or
    with "auto" from the one `time_expert_storages` finds faster here. Returns the timings (None when
    nothing was timed: a named choice, or a single storage): each storage's time relative to the first's."""
    if choice != "auto":
        if choice not in target.expert_storages:
            from ..errors import InputError

            raise InputError(f"the target's experts can be read as {' or '.join(target.expert_storages)} here, not "
                             f"{choice} (bf16 and float16 copies exist on CPU for float32 experts that those dtypes "
                             "represent exactly, as MXFP4 checkpoints' do; float16 ones on x86 builds of torch, "
                             "for fbgemm; AMX tiles on CPUs with AMX-BF16).", field="--expert-dtype")
        target.use_expert_storage(choice)
        return None
    if len(target.expert_storages) == 1:
        return None
    relative = time_expert_storages(target, batch, block)
    target.use_expert_storage(min(relative, key=relative.get))
    return relative


def expert_storage_note(target, relative: dict[str, float] | None, batch: int, block: int) -> str:
    """A log line: the storage `target` reads its experts from and, when `choose_expert_storage` timed
    them, the relative times it chose by."""
    if relative is None:
        return f"expert weights: {target.expert_storage}"
    timings = ", ".join(f"{name} {r:.3f}" for name, r in relative.items())
    return (f"expert weights: {target.expert_storage}, the faster here (an AR step plus a verify of {block} tokens at "
            f"batch {batch}, relative time: {timings})")
