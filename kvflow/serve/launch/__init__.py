"""Starting ``python -m kvflow.serve``: the flags (:mod:`.config`), their checks (:mod:`.checks`),
one-line start-up errors (:mod:`.startup`), memory budgets (:mod:`.budget`), the router process
(:mod:`.server`), its child instances (:mod:`.procs`) and console output (:mod:`.output`)."""
