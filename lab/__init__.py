"""Tools above the runtime: `radixflow diagnose` (what limits a deployment), `radixflow simulate`
(the real scheduler against a cost model in virtual time), `radixflow tree` (a picture of the radix
tree), and the `radixflow` command line itself."""
