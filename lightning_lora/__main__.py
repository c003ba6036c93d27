from lightning_lora.cli import main

main()
