-- WITH-clause lambda: whether a request falls in a time window and matches the engine / model /
-- weight-format filters ('' = any). Shared by the queries alert rules evaluate (margin_shift,
-- divergence_rates, near_tie_share), which must agree on what "in the window" means. Needs params
-- since DateTime64(3), until DateTime64(3), engine String, model String, weight_format String.
--   in_request_scope(ts, engine_, model_, weight_format_): since <= ts < until, filters matched
(ts, engine_, model_, weight_format_) -> ts >= {since:DateTime64(3)} AND ts < {until:DateTime64(3)}
    AND ({engine:String} = '' OR engine_ = {engine:String})
    AND ({model:String} = '' OR model_ = {model:String})
    AND ({weight_format:String} = '' OR weight_format_ = {weight_format:String}) AS in_request_scope,
