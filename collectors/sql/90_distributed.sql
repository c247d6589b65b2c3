-- Cluster mode only: a Distributed table named like the logical table, in front of its replicated local table.
CREATE TABLE IF NOT EXISTS ${database}.${table} ${on_cluster}
AS ${database}.${local_table}
ENGINE = Distributed(${cluster_literal}, ${database_literal}, ${local_table_literal}, rand())
