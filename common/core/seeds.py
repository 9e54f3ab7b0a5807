"""Seeds: one formula for every seed the codebase derives (mix_seed) and the run's start (seed_everything). The
standard library at its top (numpy and torch where a seed is set), so the sandbox may import it without torch."""

import random


def mix_seed(*parts: int) -> int:
    """One seed from several integers, the one formula of the codebase: (run seed, step, sample id)
    seeds a sample, so a response does not depend on its batch, the rank or a resume; (run seed,
    step, rank) a minibatch shuffle; (run seed, epoch) the data order. Python's hash() would be
    salted per process. s <- (s * 1_000_003 + part) mod (2^63 - 1), from s = 0."""
    s = 0
    for part in parts:
        s = (s * 1_000_003 + part) % (2**63 - 1)
    return s


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models initialise identically; per-sample randomness is derived
    from (seed, step, sample id) explicitly: `mix_seed(seed, step, sample id)`, the seeds
    common.core.generation.generate takes."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
