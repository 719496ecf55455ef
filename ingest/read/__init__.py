"""Reading Parquet: files and filesystems (local, S3, HDFS), footers, schemas; read units and the Ray datasource."""
