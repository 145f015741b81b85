"""Integrations with training frameworks.

Each submodule imports its framework only when used, so ``import lowbit_optim`` never pulls in
transformers or accelerate. ``lowbit_optim.integrations.transformers.register()`` makes
``TrainingArguments(optim="lowbit_adamw_4bit")`` work (see docs/huggingface.md).
"""
