"""``ps-sync`` and ``ps-async``: parameter servers (000 Fig 4.1-4.2, 002 §2.5-2.6), one module per purpose.

``protocol`` (messages, sharding plan, failure notes) <- ``worker`` (a worker's link and optimizer)
and ``server`` (a server's state) <- ``serve_sync`` / ``serve_async`` (the serving loops) <-
``strategy`` (roles and the loop's hooks; ``build_param_server`` is what STRATEGIES names).
Imports go one way, from ``strategy`` down to ``protocol``.
"""
