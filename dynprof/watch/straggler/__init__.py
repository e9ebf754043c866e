"""The watch's straggler signal: the rule (:mod:`~dynprof.watch.straggler.rule`, figures in,
verdict out) and its one sampler (:mod:`~dynprof.watch.straggler.sampler`)."""
