from mmrl.cli import main

main()
