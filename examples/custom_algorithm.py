"""DAgger on Reach2D, written only with the low-level API (:mod:`clients.lowlevel`).

The tenant's own algorithm, not one of the service's jobs: each iteration it

1. saves the session's weights for the sampler and rolls out ``episodes`` episodes with the
   policy, served by the inferencers (grouped with other tenants' requests);
2. labels every state visited with the scripted expert's action (DAgger's relabelling) and
   adds them to its aggregate dataset (iteration 0 acts with the expert: DAgger's beta = 1);
3. trains ``steps`` minibatches of the aggregate: ``forward_backward`` + ``optim_step``, all
   sent at once (pipelined), then waits for their losses.

Its success rate (of the policy's own rollouts) rises over the iterations. Against a local
stack (``joynexus up``; its roles include an inferencer)::

    python examples/custom_algorithm.py --tenant alice --iterations 6
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bus.inference import observation
from clients.lowlevel import AdamParams, ServiceClient, TrainingClient, VLABatch
from services.envs.sims import REACH2D_ID, make_env

#: Reach2D with the target's position in the state and no distractor: learnable from the
#: state in a few DAgger iterations on a CPU (the image is still the backbone's input).
ENV_KWARGS: dict[str, Any] = {"image_size": 32, "num_distractors": 0, "target_in_state": True}
HEAD: dict[str, Any] = {"kind": "oft", "action_dim": 2, "chunk_len": 1, "proprio_dim": 6}


@dataclass
class Aggregate:
    """Every state visited so far, with the expert's action there."""

    images: list[np.ndarray] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    states: list[np.ndarray] = field(default_factory=list)
    expert: list[np.ndarray] = field(default_factory=list)

    def add(self, obs: dict[str, Any], action: np.ndarray) -> None:
        self.images.append(obs["image"])
        self.instructions.append(obs["instruction"])
        self.states.append(obs["state"].astype(np.float32))
        self.expert.append(action.astype(np.float32))

    def minibatch(self, rng: np.random.Generator, size: int) -> VLABatch:
        idx = rng.choice(len(self.images), size=min(size, len(self.images)), replace=False)
        return VLABatch(
            np.stack([self.images[i] for i in idx])[:, None],
            [self.instructions[i] for i in idx],
            np.stack([self.states[i] for i in idx]),
            np.stack([self.expert[i] for i in idx])[:, None, :],
        )


async def rollouts(
    training: TrainingClient, iteration: int, episodes: int, data: Aggregate, seed: int
) -> float:
    """Roll out ``episodes`` episodes side by side (one act request per step for all of them),
    label every state with the expert; returns the success rate."""
    envs = [make_env(REACH2D_ID, **ENV_KWARGS) for _ in range(episodes)]
    obs = [env.reset(seed=seed + 1000 * iteration + i)[0] for i, env in enumerate(envs)]
    sampling = await training.save_weights_and_get_sampling_client(f"dagger-{iteration}")
    done = [False] * episodes
    success = [False] * episodes
    while not all(done):
        live = [i for i in range(episodes) if not done[i]]
        experts = {i: envs[i].unwrapped.expert_action() for i in live}  # type: ignore[attr-defined]
        for i in live:
            data.add(obs[i], experts[i])
        if iteration == 0:
            actions = {i: experts[i] for i in live}
        else:
            act = await sampling.act(
                [
                    observation([obs[i]["image"]], obs[i]["instruction"], obs[i]["state"])
                    for i in live
                ],
                deterministic=True,
            )
            actions = {i: np.clip(act.actions[k, 0], -1, 1) for k, i in enumerate(live)}
        for i in live:
            obs[i], _, terminated, truncated, info = envs[i].step(actions[i])
            if terminated or truncated:
                done[i], success[i] = True, bool(info.get("is_success", False))
    for env in envs:
        env.close()
    return sum(success) / episodes


async def dagger(
    service: ServiceClient,
    *,
    iterations: int = 6,
    episodes: int = 8,
    steps: int = 40,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Run DAgger in a new session; returns the success rate of each iteration's rollouts
    (iteration 0's are the expert's)."""
    rng = np.random.default_rng(seed)
    data = Aggregate()
    rates = []
    async with await service.create_training_client(head=HEAD, seed=seed) as training:
        for iteration in range(iterations):
            rate = await rollouts(training, iteration, episodes, data, seed)
            rates.append(rate)
            futures = []
            for _ in range(steps):
                futures.append(training.forward_backward(data.minibatch(rng, batch_size)))
                futures.append(training.optim_step(AdamParams(learning_rate, grad_clip=1.0)))
            losses = [out.loss for out in await asyncio.gather(*futures[::2])]
            await asyncio.gather(*futures[1::2])
            who = "expert" if iteration == 0 else "policy"
            print(
                f"iteration {iteration}: {who} success {rate:.2f}, {len(data.images)} labelled "
                f"states, loss {losses[0]:.4f} -> {losses[-1]:.4f}",
                flush=True,
            )
    return rates


async def main_async(args: argparse.Namespace) -> None:
    service = await ServiceClient.connect(args.url, tenant=args.tenant, home=args.home)
    try:
        rates = await dagger(service, iterations=args.iterations, episodes=args.episodes)
        print("policy success by iteration:", " ".join(f"{r:.2f}" for r in rates[1:]))
    finally:
        await service.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="bus URL (default: the local stack under --home)")
    p.add_argument("--home", default=".joynexus", help="local stack directory")
    p.add_argument("--tenant", required=True)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--episodes", type=int, default=8)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
