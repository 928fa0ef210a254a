from diffusion_rl.cli import main

main()
