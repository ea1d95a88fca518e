"""Looking at a run folder after (or during) a run: ``noria report``, ``noria inspect``, generated docs.

- ``report``: one self-contained HTML page (plots embedded as PNG data URIs, the resolved config)
  plus the plots as PNG files, from metrics.jsonl, eval.jsonl and rollouts/;
- ``trajectories``: the sampled trajectories of one step, per token, for a terminal;
- ``docs``: the configuration and metric references in docs/, generated from the config classes
  and ``noria.metric_names.METRICS``.

These modules only read run folders; nothing in the training path imports them.
"""
