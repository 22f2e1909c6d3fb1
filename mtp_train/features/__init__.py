"""The features format shared by the stages: manifest and fingerprints, shard writer, reader, verification."""
