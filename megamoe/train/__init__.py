"""`train pretrain`: Primus-format experiment configs, a megatron-core GPT/MoE model, the training loop.

Entry point: ``python -m megamoe.train pretrain --config X [--key value ...]`` (the launcher runs it
under torchrun). Modules, one concern each: ``schema`` (typed fields), ``convert`` (values by type),
``loader`` (experiment YAML, presets, ``extends``, ``${VAR}``), ``overrides`` (CLI ``--key value``),
``validate`` (settings this trainer cannot honour), ``distributed``, ``model``, ``data``, ``loop``,
``checkpoint``, ``metrics``, ``logs``.
"""
