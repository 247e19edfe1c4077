"""``python -m torchtitan_ft.titan.releases``: print the installed TorchTitan release."""

from torchtitan_ft.titan.releases import main

main()
