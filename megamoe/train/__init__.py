"""`train pretrain`: Primus-format experiment configs, a megatron-core GPT/MoE model, the training loop.

Entry point: ``python -m megamoe.train pretrain --config X [--key value ...]`` (the launcher runs it
under torchrun). One concern per module: ``schema`` (the typed settings), ``convert`` (values by
type), ``loader`` (experiment YAML, presets, ``extends``, ``${VAR}``), ``overrides`` (CLI
``--key value``), ``config`` (all of those in one call, export), ``validate`` (start-up checks, run
plan), ``distributed`` (process groups), ``model`` (TransformerConfig, GPTModel, the MegaMoE switch),
``attention`` (MLA core attention without Transformer Engine), ``data`` (mock data by iteration),
``loop`` (the steps), ``checkpoint`` (dist checkpoints, resume), ``metrics``, ``logs``.
"""
