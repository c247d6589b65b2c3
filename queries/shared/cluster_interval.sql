-- WITH-clause lambdas: the 95 % interval of a rate measured over clusters of samples (episodes).
-- Samples of one episode are not independent of each other (the same prompts, the same cache
-- history), so the episode is the unit of resampling. Input per cluster, in a fixed order (sorted
-- by the cluster key, so the same data always gives the same interval): its numerator and
-- denominator; the rate is sum(nums) / sum(dens). Needs shared_wilson_interval before it.
--   rate_interval_method(nums, dens):
--     INTERVAL_WILSON when every cluster is one yes/no sample (den 1, num 0 or 1), or when every
--       cluster shows the same rate (e.g. no flip anywhere: resampling clusters cannot show any
--       spread, and nothing shows the samples to be correlated): the Wilson score interval of k/n
--       over the samples (n = sum(dens));
--     INTERVAL_CLUSTER_BOOTSTRAP otherwise: clusters drawn with replacement, 2000 resamples,
--       percentile interval (2.5 % and 97.5 %); the draws are a hash of (resample, slot), so the
--       interval is deterministic
--   rate_interval_low(nums, dens), rate_interval_high(nums, dens): the interval's ends
(n, resample) -> arrayMap(slot -> toUInt32(sipHash64(resample, slot) % n) + 1, range(n)) AS cluster_draw,
(nums, dens) -> arraySort(arrayMap(
    draw -> arraySum(arrayMap(i -> nums[i], draw)) / arraySum(arrayMap(i -> dens[i], draw)),
    arrayMap(resample -> cluster_draw(length(nums), resample), range(2000)))) AS cluster_bootstrap_rates,
(nums, dens) -> arrayAll(x -> x = 0 OR x = 1, nums) AND arrayAll(d -> d = 1, dens) AS one_sample_per_cluster,
(nums, dens) -> arrayAll((x, d) -> x * dens[1] = nums[1] * d, nums, dens) AS same_rate_per_cluster,
(nums, dens) -> if(one_sample_per_cluster(nums, dens) OR same_rate_per_cluster(nums, dens), '${INTERVAL_WILSON}',
    '${INTERVAL_CLUSTER_BOOTSTRAP}') AS rate_interval_method,
(nums, dens) -> if(one_sample_per_cluster(nums, dens) OR same_rate_per_cluster(nums, dens),
    wilson_low(arraySum(nums) / arraySum(dens), arraySum(dens)), cluster_bootstrap_rates(nums, dens)[50])
    AS rate_interval_low,
(nums, dens) -> if(one_sample_per_cluster(nums, dens) OR same_rate_per_cluster(nums, dens),
    wilson_high(arraySum(nums) / arraySum(dens), arraySum(dens)), cluster_bootstrap_rates(nums, dens)[1951])
    AS rate_interval_high,
