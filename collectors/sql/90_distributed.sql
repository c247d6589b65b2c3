-- Cluster mode only: a Distributed table named like the logical table, in front of its replicated local table,
-- sharded so that copies of a span land on one shard, where they fold (schema.SHARDING_KEYS).
CREATE TABLE IF NOT EXISTS ${database}.${table} ${on_cluster}
AS ${database}.${local_table}
ENGINE = Distributed(${cluster_literal}, ${database_literal}, ${local_table_literal}, ${sharding_key})
