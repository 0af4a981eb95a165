"""The decoding algorithm, independent of where the models run: the loop (`loop.Decoder`), the
drafters, the modes, sampling and the scores the loop decides with, grammars and logit rules,
the cost model, streaming text, and the statistics of a generation."""
