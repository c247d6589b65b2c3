-- WITH-clause lambda: the bin a raw-logit top-two margin falls in, labelled as
-- kvtrace.semconv.MARGIN_BIN_LABELS (the fork view colours tokens by the same bins).
--   margin_bin_of(margin): the label of the first bin whose upper edge (MARGIN_BIN_EDGES) is above
--     margin; the open last bin otherwise (NaN included)
margin -> ${MARGIN_BIN_LABELS}[arrayCount(edge -> NOT (margin < edge), ${MARGIN_BIN_EDGES}) + 1] AS margin_bin_of,
