"""Drivers of a running stack: the demo and the benchmarks.

They reach the stack through the tenant SDK (:mod:`clients`), start it with
:mod:`services.launcher`, and use the model core (:mod:`vla`) directly where a benchmark
measures it in-process; nothing in :mod:`services` imports them. :mod:`bench.cli` is the
``joynexus`` command: the tenant commands of :mod:`clients.cli` plus the operator ones.
"""
