"""Getting spans into ClickHouse: schema, spool ingest, direct span writer."""
