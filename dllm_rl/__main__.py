from dllm_rl.cli import main

main()
