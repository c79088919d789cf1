"""Layer 5, tools: the ``pagedkv`` command (cli), the end-to-end demo, the serving simulator
(sim, its traces and report), and the model presets of ``pagedkv size``.

May import every layer below; nothing below imports it.
"""
