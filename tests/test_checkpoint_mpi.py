"""Checkpoints under a real mpirun: save at 3 ranks, load at 2 and 4; a corrupted file ends the
job on every rank with an error naming it (no rank waits forever); ``zerosim train`` resumed
at another world size reads every sample of the stream once."""

import json
import time

import numpy as np
import pytest
from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("mpi_ckpt")
    proc = run_mpi(3, ["tests/helpers/ckpt_worker.py", "save", str(ckpt)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK rank") == 3
    return ckpt


@pytest.mark.parametrize("n, variant", [(2, "1"), (4, "megatron")])
def test_stage2_checkpoint_of_3_ranks_continues_on_other_ranks_and_stage(saved, n, variant):
    proc = run_mpi(
        n, ["tests/helpers/ckpt_worker.py", "load", str(saved), "3", variant], timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK rank") == n


def test_corrupted_shard_fails_on_every_rank_naming_the_file(saved, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    bad = "rank00001.group0.exp_avg_sq.npy"
    path = ckpt / "global_step4" / bad
    raw = bytearray(path.read_bytes())
    raw[200] ^= 1
    path.write_bytes(bytes(raw))
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/helpers/ckpt_worker.py", "load_corrupt", str(ckpt), bad], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
    assert all(f"rank {r}: CheckpointError" in proc.stdout for r in range(3)), proc.stdout
    assert proc.stdout.count("OK rank") == 3


def test_save_failing_on_one_rank_for_a_file_size_limit_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 meets a real EFBIG (RLIMIT_FSIZE) while saving: every rank raises an OSError
    naming rank 1's file, no partial tag or temporary file is left, the last save loads."""
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/helpers/ckpt_worker.py", "save_too_large", str(tmp_path / "c"), "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 120
    lines = [line for line in proc.stdout.splitlines() if ": OSError: " in line]
    assert len(lines) == 3, proc.stdout
    for line in lines:
        assert "File too large" in line and "rank00001.group0.master.npy" in line, line
    assert proc.stdout.count("OK rank") == 3


# The resume chain: (world size, {policy: global step to train to}); it resumes 5 → 4 → 3 → 2 → 3.
STREAM_LEN = 203  # an epoch's tail of 203 mod G samples is dropped (drop_last)
POLICIES = {
    # micro-batch and accumulation fixed: the global batch G = 2·2·N changes with N, so the
    # saved positions 60, 124 and (epoch 1) 8 are not multiples of the next run's m·N
    "micro": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
    # the global batch fixed at 60: accumulation 60/N changes with N
    "global": {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 1},
}
CHAIN = [
    (5, {"micro": 3, "global": 1}),
    (4, {"micro": 7, "global": 2}),
    (3, {"micro": 12, "global": 3}),
    (2, {"micro": 15, "global": 4}),
    (3, {"micro": 18, "global": 5}),
]


def expected_reads(policy: str) -> dict[tuple[int, int], list[list[int]]]:
    """{(launch, rank): index arrays in reading order}, from docs/data.md's definition alone:
    epoch e's order is default_rng((0, e)).permutation(len); global batches of G = m·k·N are
    laid from where the previous run stopped; at micro-step j rank r reads positions
    [(j·N + r)·m, (j·N + r + 1)·m) of its global batch; an epoch ends when fewer than G
    positions remain, and the next starts at its position 0."""
    reads: dict[tuple[int, int], list[list[int]]] = {}
    epoch, position, done = 0, 0, 0
    for launch, (n, targets) in enumerate(CHAIN):
        cfg = POLICIES[policy]
        m = cfg["train_micro_batch_size_per_gpu"]
        k = cfg.get("gradient_accumulation_steps") or cfg["train_batch_size"] // (m * n)
        g = m * k * n
        for r in range(n):
            reads[launch, r] = []
        for _ in range(targets[policy] - done):
            if position + g > STREAM_LEN:
                epoch, position = epoch + 1, 0
            perm = np.random.default_rng((0, epoch)).permutation(STREAM_LEN)
            for j in range(k):
                for r in range(n):
                    first = position + (j * n + r) * m
                    reads[launch, r].append(perm[first : first + m].tolist())
            position += g
        done = targets[policy]
    return reads


@pytest.mark.slow
def test_train_resumed_at_other_world_sizes_reads_the_sample_stream_exactly_once(tmp_path):
    """``zerosim train --resume`` on 5 → 4 → 3 → 2 → 3 ranks: every rank reads exactly the
    samples one uninterrupted stream gives it; none is read twice, none skipped."""
    (tmp_path / "length").write_text(str(STREAM_LEN))
    for policy, batch in POLICIES.items():
        config = {**batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        config["zero_optimization"] = {"stage": 1}
        (tmp_path / f"{policy}.json").write_text(json.dumps(config))
    for launch, (n, targets) in enumerate(CHAIN):
        args = ["tests/helpers/ckpt_worker.py", "resume_stream", str(tmp_path), str(launch)]
        proc = run_mpi(n, [*args, json.dumps(targets)], timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("OK rank") == n
    for policy in POLICIES:
        for (launch, rank), want in expected_reads(policy).items():
            path = tmp_path / f"{policy}.launch{launch}.rank{rank}.json"
            assert json.loads(path.read_text()) == want, (policy, launch, rank)
