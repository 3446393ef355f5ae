"""Benchmarks (`tidespec bench ...`): results go to bench/results/ as JSON + a markdown table."""
