"""Beyond one replica: a simulated cluster of engines behind a router (``cluster``, ``routers``), disaggregated
prefill and decode, multi-turn conversations (``multiturn``), ``python -m minibatch simulate --replicas N``
(``simulate``) and sweeps of many runs, here or on Ray (``sweep``)."""
