"""What the distributed stores share: configuration, the protocol, key placement,
optimizer-state split and merge, and the membership client.

``worker/`` is the backend behind ``dist_sync``/``dist_async`` stores, ``server/`` the
parameter server, ``scheduler/`` the rendezvous; none of them imports another.
"""
