"""The built-in ``gomoku`` environment: the rules (wins in all four directions), move parsing,
invalid-move penalties, the opponent, rewards for win / loss / draw, and determinism by seed;
and its two-role ``gomoku_selfplay`` variant: turns, rewards per role, invalid moves, the
heuristic as one role (played by the rollout: test_multi_agent.py)."""

from __future__ import annotations

import random

import pytest

from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.game import StepResult
from opentinker.services.envhub.games.gomoku_board import Board, Stone
from opentinker.services.envhub.games.gomoku_env import (
    DRAW_REWARD,
    INVALID_MOVE_PENALTY,
    LOSS_REWARD,
    WIN_REWARD,
    GomokuGame,
)
from opentinker.services.envhub.games.gomoku_opponent import HeuristicOpponent
from opentinker.services.envhub.games.gomoku_selfplay import GomokuSelfPlayGame

# Four stones of a line and the cell that completes it, in each direction: - | \ /
LINES = {
    "horizontal": ([(4, 1), (4, 2), (4, 3), (4, 5)], (4, 4)),
    "vertical": ([(0, 7), (1, 7), (2, 7), (3, 7)], (4, 7)),
    "diagonal": ([(2, 2), (3, 3), (5, 5), (6, 6)], (4, 4)),
    "anti_diagonal": ([(0, 8), (1, 7), (2, 6), (3, 5)], (4, 4)),
}


def fresh_game(seed: int = 0, **options: str) -> GomokuGame:
    game = GomokuGame()
    game.reset(seed=seed, **options)
    game.board = Board(9, 5)  # an empty board whoever the seed made open
    return game


def board_with(stones: list[tuple[int, int]], stone: Stone = Stone.BLACK) -> Board:
    board = Board(9, 5)
    for cell in stones:
        board.place(cell, stone)
    return board


@pytest.mark.unit
@pytest.mark.parametrize("direction", sorted(LINES))
def test_five_in_a_row_wins_in_every_direction(direction: str) -> None:
    four, last = LINES[direction]
    board = board_with(four)
    assert board.longest_line(four[0], Stone.BLACK) < 5
    assert board.place(last, Stone.BLACK) is True  # the fifth stone, in the middle or the end


@pytest.mark.unit
@pytest.mark.parametrize("direction", sorted(LINES))
def test_the_model_wins_with_its_fifth_stone_in_every_direction(direction: str) -> None:
    four, last = LINES[direction]
    game = fresh_game()
    game.board = board_with(four)
    result = game.step(f"I complete the line: {game.board.name(last)}")
    assert (result.reward, result.done, result.info["outcome"]) == (WIN_REWARD, True, "win")
    assert "you win" in result.observation


@pytest.mark.unit
def test_four_is_not_five_and_a_broken_line_is_not_five() -> None:
    assert board_with([(0, 0), (0, 1), (0, 2)]).place((0, 3), Stone.BLACK) is False
    board = board_with([(0, 0), (0, 1), (0, 3), (0, 4)])
    board.place((0, 2), Stone.WHITE)
    assert board.place((0, 5), Stone.BLACK) is False  # X X O X X X: three, not five


@pytest.mark.unit
def test_six_in_a_row_also_wins() -> None:
    board = board_with([(8, 0), (8, 1), (8, 3), (8, 4), (8, 5)])
    assert board.place((8, 2), Stone.BLACK) is True


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "cell"),
    [
        ("E5", (4, 4)),
        ("e5", (4, 4)),
        ("I'll play A1.", (0, 0)),
        ("Thinking about C3... my move is I9", (8, 8)),  # the last coordinate wins
        ("E-5", (4, 4)),
        ("move: b 7", (6, 1)),
    ],
)
def test_moves_are_parsed(text: str, cell: tuple[int, int]) -> None:
    assert Board(9, 5).parse_move(text) == cell


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "no move found"), ("pass", "no move found"), ("J5", "off the board"), ("E10", "off")],
)
def test_unreadable_moves_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Board(9, 5).parse_move(text)


@pytest.mark.unit
@pytest.mark.parametrize("move", ["no idea", "Z9", "E5"])  # unreadable, off board, taken
def test_an_invalid_move_is_penalised_and_leaves_the_board_as_it_was(move: str) -> None:
    game = fresh_game()
    game.board.place((4, 4), Stone.WHITE)
    before = game.board.render()
    result = game.step(move)
    assert (result.reward, result.done) == (INVALID_MOVE_PENALTY, False)
    assert result.observation.startswith("Invalid move")
    assert before in result.observation  # the board is shown again, unchanged
    assert game.board.render() == before
    assert result.info["invalid_moves"] == "1"


@pytest.mark.unit
def test_too_many_invalid_moves_lose_the_game() -> None:
    game = fresh_game(max_invalid_moves="2")
    assert game.step("nothing").done is False
    result = game.step("still nothing")
    assert (result.reward, result.done, result.info["outcome"]) == (LOSS_REWARD, True, "loss")


@pytest.mark.unit
def test_the_opponent_takes_its_win_and_the_model_loses() -> None:
    game = fresh_game()
    for cell in [(0, 0), (1, 0), (2, 0), (3, 0)]:
        game.board.place(cell, Stone.WHITE)
    result = game.step("I9")  # ignores the threat at A5
    assert (result.reward, result.done, result.info["outcome"]) == (LOSS_REWARD, True, "loss")
    assert game.board[(4, 0)] is Stone.WHITE
    assert "you lose" in result.observation


@pytest.mark.unit
def test_the_opponent_blocks_a_four() -> None:
    board = board_with([(4, 0), (4, 1), (4, 2), (4, 3)])  # X X X X . at the left edge
    board.place((0, 8), Stone.WHITE)
    assert HeuristicOpponent(Stone.WHITE, random.Random(0)).choose(board) == (4, 4)


@pytest.mark.unit
def test_a_full_board_without_five_is_a_draw() -> None:
    game = fresh_game()
    for r in range(9):  # columns in pairs, shifted every row: no line longer than 2
        for c in range(9):
            stone = Stone.BLACK if ((c + 2 * r) // 2) % 2 == 0 else Stone.WHITE
            if (r, c) != (8, 8):
                game.board.place((r, c), stone)
    result = game.step("I9")
    assert (result.reward, result.done, result.info["outcome"]) == (DRAW_REWARD, True, "draw")


@pytest.mark.unit
def test_the_same_seed_replays_the_same_game() -> None:
    def play(seed: int) -> list[str]:
        game = GomokuGame()
        transcript = [game.reset(seed=seed)]
        for move in ["E5", "D4", "F6", "C3", "G7"]:
            result = game.step(move)
            transcript.append(result.observation)
            if result.done:
                break
        return transcript

    assert play(11) == play(11)
    openings = {play(seed)[0] for seed in range(12)}
    assert len(openings) > 1  # seeds differ in who opens and where


@pytest.mark.unit
def test_the_board_is_rendered_with_coordinates() -> None:
    board = board_with([(0, 0)])
    board.place((8, 8), Stone.WHITE)
    lines = board.render().splitlines()
    assert lines[0].split() == list("ABCDEFGHI")
    assert lines[1].split() == ["1", "X", *"." * 8]
    assert lines[9].split() == ["9", *"." * 8, "O"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "options", [{"opponent_skill": "2"}, {"max_invalid_moves": "0"}, {"opponent_skill": "x"}]
)
def test_bad_options_are_refused(options: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="env option"):
        GomokuGame().reset(seed=0, **options)


def play_moves(game: GomokuSelfPlayGame, moves: list[str]) -> list[StepResult]:
    return [game.step(move) for move in moves]


@pytest.mark.unit
def test_gomoku_selfplay_alternates_roles_and_pays_the_winner() -> None:
    game = GomokuSelfPlayGame()
    first = game.reset(seed=3)
    assert game.first_role() == "black" and "Your move (black, X)" in first
    # Black builds A1..E1 while white plays A9..D9.
    results = play_moves(game, ["A1", "A9", "B1", "B9", "C1", "C9", "D1", "D9"])
    assert [r.next_role for r in results] == ["white", "black"] * 4
    assert all(not r.done and r.role_rewards == {} for r in results)
    assert "Black (X) played A1." in results[0].observation
    assert "Your move (white, O)" in results[0].observation
    last = game.step("my move: E1")
    assert last.done and last.role_rewards == {"black": 1.0, "white": 0.0}
    assert last.info["outcome"] == "black_win" and last.info["winner"] == "black"


@pytest.mark.unit
def test_gomoku_selfplay_invalid_moves_cost_their_role_and_lose_at_the_limit() -> None:
    game = GomokuSelfPlayGame()
    game.reset(seed=0, max_invalid_moves="2")
    game.step("E5")
    again = game.step("E5")  # white: taken
    assert not again.done and again.next_role == "white"
    assert again.role_rewards == {"white": -0.1} and again.reward == -0.1
    lost = game.step("no move here")
    assert lost.done and lost.info["winner"] == "black"
    assert lost.role_rewards == {"black": 1.0, "white": -0.1}


@pytest.mark.unit
def test_gomoku_selfplay_can_play_a_random_cell_for_an_invalid_move() -> None:
    game = GomokuSelfPlayGame()
    game.reset(seed=5, invalid_move="random")
    result = game.step("no idea")
    assert not result.done and result.next_role == "white"
    assert result.role_rewards == {"black": -0.1} and game.board.moves == 1
    assert "a random one was played" in result.observation
    with pytest.raises(ValueError, match="invalid_move"):
        game.reset(seed=0, invalid_move="skip")


@pytest.mark.unit
def test_gomoku_selfplay_against_the_heuristic_pays_only_the_agent() -> None:
    game = GomokuSelfPlayGame()
    first = game.reset(seed=1, heuristic_plays="alternate")  # odd seed: the heuristic is black
    assert game.first_role() == "white" and "opened at" in first
    for _ in range(40):
        result = game.step(next(game.board.name(c) for c in game.board.empty_cells()))
        if result.done:
            break
        assert result.next_role == "white"
    assert result.done and set(result.role_rewards) == {"white"}
    assert result.info["opponent"] == "heuristic" and result.info["heuristic_role"] == "black"
    with pytest.raises(ValueError, match="heuristic_plays"):
        game.reset(seed=0, heuristic_plays="red")


@pytest.mark.integration
def test_a_whole_game_over_grpc_ends_with_an_outcome() -> None:
    handle = serve(GomokuGame, block=False)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            first = stub.Reset(pb.ResetRequest(episode_id="g", seed=3), timeout=5)
            assert "Your move (X)" in first.observation and "A B C D E F G H I" in first.observation
            rng = random.Random(0)
            cells = [f"{col}{row}" for col in "ABCDEFGHI" for row in range(1, 10)]
            rng.shuffle(cells)
            rewards, reply = [], None
            for turn, move in enumerate(cells):  # a random player; some moves hit taken cells
                reply = stub.Step(pb.StepRequest(episode_id="g", action=move), timeout=5)
                rewards.append(reply.reward)
                if reply.done:
                    break
                assert turn < GomokuGame.max_turns
            assert reply is not None and reply.done
            assert reply.info["outcome"] in {"win", "loss", "draw"}
            assert set(rewards) <= {0.0, INVALID_MOVE_PENALTY, WIN_REWARD, LOSS_REWARD}
    finally:
        handle.stop(grace_s=0)
