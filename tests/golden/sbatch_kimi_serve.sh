#!/bin/bash

# Parameters
#SBATCH --account=spec-decoding
#SBATCH --constraint=h100
#SBATCH --cpus-per-task=32
#SBATCH --dependency=afterok:1003
#SBATCH --error=/shared/runs/kimi_eagle3/jobs/%j_0_log.err
#SBATCH --gpus-per-node=8
#SBATCH --job-name=kimi_eagle3-serve
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --mem=1024GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/shared/runs/kimi_eagle3/jobs/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=normal
#SBATCH --signal=USR2@120
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
source /shared/envs/eagle-orchestrator/bin/activate
export MLFLOW_TRACKING_URI=http://mlflow.internal:5000

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/runs/kimi_eagle3/jobs/%j_%t_log.out --error /shared/runs/kimi_eagle3/jobs/%j_%t_log.err --kill-on-bad-exit=1 python -u -m submitit.core._submit /shared/runs/kimi_eagle3/jobs
