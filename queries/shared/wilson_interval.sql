-- WITH-clause lambdas: the Wilson score 95 % interval (z = 1.96) of a rate k/n, clamped to [0, 1]
-- (rounding can step a hair outside). Shared by divergence_rates and flip_rate_by_margin.
(rate, n) -> greatest(0., (rate + 1.96 * 1.96 / (2 * n)
    - 1.96 * sqrt(rate * (1 - rate) / n + 1.96 * 1.96 / (4 * n * n))) / (1 + 1.96 * 1.96 / n)) AS wilson_low,
(rate, n) -> least(1., (rate + 1.96 * 1.96 / (2 * n)
    + 1.96 * sqrt(rate * (1 - rate) / n + 1.96 * 1.96 / (4 * n * n))) / (1 + 1.96 * 1.96 / n)) AS wilson_high,
