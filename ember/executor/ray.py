"""Ranks 1..N-1 as Ray actors, placed on the Ray cluster this process is connected to (``ray.init()`` reads
RAY_ADDRESS; with no cluster running, Ray starts a local one, which shutdown stops again).

Rank 0 stays in the engine's process and opens the TCPStore on this node's address; each actor joins through it
and serves like any other rank (``run_rank``). On CUDA an actor asks Ray for one GPU; on CPU it reserves no CPU
(``num_cpus=0``, spread over the nodes) so that T x P ranks fit on small nodes. ember must be installed on every
node, in the same version.
"""

from __future__ import annotations

from ember.distributed import groups
from ember.executor.distributed import DistributedExecutor
from ember.executor.rank import RankSpec


class _RankActor:
    def serve(self, spec: RankSpec) -> None:
        from ember.executor.rank import run_rank

        run_rank(spec)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


class RayExecutor(DistributedExecutor):
    def _start_ranks(self):
        try:
            import ray
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs ray: pip install ray") from e
        import torch.distributed as dist

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, self.world, is_master=True, timeout=groups.timeout(), wait_for_workers=False)
        cuda = self.resolved.model.device.startswith("cuda")
        options = {"num_gpus": 1, "num_cpus": 0} if cuda else {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
        actor_cls = ray.remote(_RankActor).options(**options)
        self.actors = [actor_cls.remote() for _ in range(1, self.world)]
        # local ranks number the GPUs on each node: Ray sets CUDA_VISIBLE_DEVICES per actor, so each sees its own as 0
        self.refs = [a.serve.remote(self.spec(rank, host, store.port, local_rank=0 if cuda else rank))
                     for rank, a in enumerate(self.actors, start=1)]
        return store

    def _dead_ranks(self) -> list[str]:
        import ray

        out = []
        for rank, ref in enumerate(getattr(self, "refs", []), start=1):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref)
                    out.append(f"rank {rank} (Ray actor) returned early")
                except Exception as e:  # the actor's own error, or Ray's ActorDiedError
                    out.append(f"rank {rank} (Ray actor) failed: {type(e).__name__}")
        return out

    def _stop_ranks(self) -> None:
        import ray

        refs = getattr(self, "refs", [])
        if refs and self.dead is None:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "_own_ray", False):
            ray.shutdown()
