"""Text sources, tokenizers, batches and synthetic tasks.

Import from the two front modules; they re-export everything below them:

- ``corpus``: ``Corpus``, ``load_corpus``, ``train_tokenizer``, ``BatchSampler``, plus the names of
  ``sources`` (where text comes from), ``tokenizers`` (BPE, byte and SmolLM2 tokenizers) and ``tokens``
  (the token cache and train/validation split); ``files`` holds the cache folder and atomic writes.
- ``tasks``: the task registry (``make_task``), scoring and mixing, over the generators in
  ``deduction``, ``kinship``, ``iterated`` and ``knowledge`` (recall and the fact battery), which share
  ``examples`` (the ``Example`` record and invented names).
"""
