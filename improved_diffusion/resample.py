"""
Timestep samplers for training: which t each example is trained at, and the importance weight
that keeps the loss an unbiased estimate of the uniform-t objective.

Draws use the global `np.random` state, as upstream. Every sampler has `state_dict()` /
`load_state_dict()` whose dicts hold only Python scalars, lists, strings and torch tensors, so they
round-trip through `torch.save` / `torch.load(weights_only=True)`.
"""
from abc import ABC, abstractmethod

import numpy as np
import torch as th

from . import dist_util
from .infra.errors import UsageError


def create_named_schedule_sampler(name, diffusion):
    """
    Create a ScheduleSampler from a library of pre-defined samplers.

    :param name: "uniform" or "loss-second-moment" (the `--schedule_sampler` flag).
    :param diffusion: the diffusion object to sample for (its num_timesteps is used).
    :raises UsageError: for an unknown name (one line naming the flag, exit 2).
    """
    if name == "uniform":
        return UniformSampler(diffusion)
    elif name == "loss-second-moment":
        return LossSecondMomentResampler(diffusion)
    raise UsageError(
        f"unknown --schedule_sampler {name!r}; use 'uniform' or 'loss-second-moment'"
    )


class ScheduleSampler(ABC):
    """
    A distribution over timesteps in the diffusion process, intended to reduce variance of the
    objective.

    By default, samplers perform unbiased importance sampling, in which the objective's mean is
    unchanged. Subclasses may override sample() to change how resampled terms are reweighted.
    """

    name = None

    @abstractmethod
    def weights(self):
        """A numpy array [T] of positive weights, one per diffusion step (not normalised)."""

    def sample(self, batch_size, device):
        """
        Importance-sample timesteps for a batch (uses np.random).

        :param batch_size: N, the number of timesteps.
        :param device: the torch device to put the results on.
        :return: (timesteps, weights): a long tensor [N] of indices and a float tensor [N] of
            weights 1 / (T * p(t)) to scale the per-example losses by.
        """
        w = self.weights()
        p = w / np.sum(w)
        indices_np = np.random.choice(len(p), size=(batch_size,), p=p)
        indices = th.from_numpy(indices_np).long().to(device)
        weights_np = 1 / (len(p) * p[indices_np])
        weights = th.from_numpy(weights_np).float().to(device)
        return indices, weights

    def state_dict(self):
        """The sampler's state: a plain dict (weights_only-loadable)."""
        return {"name": self.name}

    def load_state_dict(self, state_dict):
        """Restore state from `state_dict()` output; raises ValueError if it is another kind."""
        self._check_name(state_dict)

    def _check_name(self, state_dict):
        if not isinstance(state_dict, dict) or state_dict.get("name") != self.name:
            got = state_dict.get("name") if isinstance(state_dict, dict) else type(state_dict)
            raise ValueError(
                f"schedule sampler state is for {got!r}, not {self.name!r}; pass the same "
                "--schedule_sampler as the run being resumed"
            )


class UniformSampler(ScheduleSampler):
    """Every timestep equally likely; all weights 1."""

    name = "uniform"

    def __init__(self, diffusion):
        self.diffusion = diffusion
        self._weights = np.ones([diffusion.num_timesteps])

    def weights(self):
        return self._weights


class LossAwareSampler(ScheduleSampler):
    """A sampler whose distribution is updated from the training losses."""

    def update_with_local_losses(self, local_ts, local_losses):
        """
        Update the reweighting using losses from this rank, gathered from all ranks.

        Collective: call from all ranks with the same arguments (each rank its own local
        timesteps and losses; batch sizes may differ between ranks). Without an initialised
        torch.distributed process group this is a plain local update. Every rank ends with
        identical sampler state.

        :param local_ts: a long tensor [N] of timesteps.
        :param local_losses: a float tensor [N] of losses, one per timestep.
        """
        # (t, loss) pairs in one float64 tensor (exact for both): one gather, one host transfer
        pairs = th.stack([local_ts.double(), local_losses.detach().double()], dim=1).reshape(-1)
        if dist_util.get_world_size() > 1:
            pairs = th.cat(dist_util.all_gather_varlen(pairs))
        pairs = pairs.reshape(-1, 2).tolist()
        self.update_with_all_losses([int(t) for t, _ in pairs], [loss for _, loss in pairs])

    @abstractmethod
    def update_with_all_losses(self, ts, losses):
        """
        Update the reweighting using losses from the whole (global) batch.

        Sub-classes should override this method to update the reweighting using losses from the
        model. This method directly updates the reweighting without synchronizing between
        workers; it is called by update_with_local_losses with the same arguments on all ranks.

        :param ts: a list of int timesteps.
        :param losses: a list of float losses, one per timestep.
        """


class LossSecondMomentResampler(LossAwareSampler):
    """
    Sample t with probability proportional to sqrt(E[loss_t^2]) over the last
    `history_per_term` losses of each t (mixed with `uniform_prob` of uniform), once every t has
    a full history; uniform until then (warm-up).
    """

    name = "loss-second-moment"

    def __init__(self, diffusion, history_per_term=10, uniform_prob=0.001):
        self.diffusion = diffusion
        self.history_per_term = history_per_term
        self.uniform_prob = uniform_prob
        self._loss_history = np.zeros(
            [diffusion.num_timesteps, history_per_term], dtype=np.float64
        )
        self._loss_counts = np.zeros([diffusion.num_timesteps], dtype=np.int64)

    def weights(self):
        if not self._warmed_up():
            return np.ones([self.diffusion.num_timesteps], dtype=np.float64)
        weights = np.sqrt(np.mean(self._loss_history ** 2, axis=-1))
        weights /= np.sum(weights)
        weights *= 1 - self.uniform_prob
        weights += self.uniform_prob / len(weights)
        return weights

    def update_with_all_losses(self, ts, losses):
        for t, loss in zip(ts, losses):
            t = int(t)
            if self._loss_counts[t] == self.history_per_term:
                # Shift out the oldest loss term.
                self._loss_history[t, :-1] = self._loss_history[t, 1:]
                self._loss_history[t, -1] = loss
            else:
                self._loss_history[t, self._loss_counts[t]] = loss
                self._loss_counts[t] += 1

    def _warmed_up(self):
        return bool((self._loss_counts == self.history_per_term).all())

    def state_dict(self):
        """
        {"name", "history_per_term", "uniform_prob", "_loss_history": float64 tensor [T, H],
        "_loss_counts": int64 tensor [T]} (copies; weights_only-loadable).
        """
        return {
            "name": self.name,
            "history_per_term": int(self.history_per_term),
            "uniform_prob": float(self.uniform_prob),
            "_loss_history": th.tensor(self._loss_history, dtype=th.float64),
            "_loss_counts": th.tensor(self._loss_counts, dtype=th.int64),
        }

    def load_state_dict(self, state_dict):
        self._check_name(state_dict)
        history = np.array(
            th.as_tensor(state_dict["_loss_history"], dtype=th.float64).cpu().numpy(),
            dtype=np.float64,
        )
        counts = np.array(
            th.as_tensor(state_dict["_loss_counts"], dtype=th.int64).cpu().numpy(),
            dtype=np.int64,
        )
        want = (self.diffusion.num_timesteps,)
        if history.ndim != 2 or history.shape[0] != want[0] or counts.shape != want:
            raise ValueError(
                f"schedule sampler state has loss history for {history.shape[0]} timesteps, "
                f"but the diffusion has {want[0]}; resume with the same --diffusion_steps"
            )
        self.history_per_term = int(state_dict.get("history_per_term", history.shape[1]))
        if history.shape[1] != self.history_per_term:
            raise ValueError(
                f"schedule sampler state: loss history has {history.shape[1]} columns but "
                f"history_per_term is {self.history_per_term}"
            )
        self.uniform_prob = float(state_dict.get("uniform_prob", self.uniform_prob))
        self._loss_history = history
        self._loss_counts = counts
