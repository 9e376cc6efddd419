"""The framework-agnostic runtime: engine, negotiation, fusion, process sets, rendezvous."""
