"""Mesh peers on Ray: experts held and computed by actors on other nodes (``mesh``). The
engine's side, :mod:`.tier` (:class:`~.tier.PeerTier`), made of :mod:`.start` (placement,
the peers started and checked), :mod:`.calls` (rows sent, outputs received),
:mod:`.health` (probes, the rotation) and :mod:`.peer_state` (one peer's state and
counters); one MoE layer's view of it, :mod:`.layer_view`; a peer's side, :mod:`.shard`
(its experts read from the checkpoint, its kernel), proving itself with :mod:`.check`;
joining the cluster, :mod:`.ray_cluster`. Ray is optional (the ``mesh`` extra),
imported only when a mesh starts."""
