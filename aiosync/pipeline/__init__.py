"""The sender's concurrent stages over any data plane and any number of engine links.

Nothing here imports a socket library, shared memory or CUDA: links carry a
:class:`~aiosync.channels.base.Channel`, buffers belong to a
:class:`~aiosync.planes.base.SenderPlane`.
"""
