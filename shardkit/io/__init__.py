"""Reading bytes from local and remote storage: ranged HTTP and S3 reads, the
remote reader with readahead and retries, the local cache, and opening files
with their compression. Nothing here knows a shard format."""
