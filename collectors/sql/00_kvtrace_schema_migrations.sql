-- kvtrace_schema_migrations: the schema versions this database has (collectors/migrations/NNNN_name.sql).
-- One row per application: two processes that upgraded a server at once leave the version twice.
-- On a cluster every node holds all of it (one replica set across the shards).
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_schema_migrations} ${on_cluster} (
    version UInt32,
    name String,
    applied_at DateTime64(6) DEFAULT now64(6)
) ENGINE = ${versions_engine}
ORDER BY version
