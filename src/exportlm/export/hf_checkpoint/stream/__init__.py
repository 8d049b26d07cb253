"""The streamed source of the ``hf_checkpoint`` target: a checkpoint directory one decoder layer at a time.

:func:`~exportlm.export.hf_checkpoint.stream._pipeline.stream_checkpoint` is what
``export_model("hf_checkpoint", DIR, out, ...)`` runs when the directory streams
(:mod:`exportlm.export.hf_checkpoint.directory`). The public face, with the budget rules
the command line reads, is :mod:`exportlm.stream`; see ``docs/streaming.md``. Nothing is
imported here, so importing one of the modules imports only what it needs.
"""
