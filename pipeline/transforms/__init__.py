"""Float-graph transforms that change no float result: constant folding (``folding``), specialization
to static shapes (``specialize``) and recurrent-op unrolling (``rnn``). Imports the framework and
``pipeline.graph``."""
