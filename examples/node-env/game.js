// Guess the number: the game itself, with no gRPC in sight.
//
// Reset picks a secret whole number in 1..maxNumber from the episode's seed (the same seed gives
// the same secret, on any machine). Each step reads the first whole number in the model's reply:
// a correct guess wins (reward 1, done); otherwise the reply says "higher" or "lower". Every
// reply uses up one guess; when none are left the episode ends with reward 0.

'use strict';

const DEFAULTS = Object.freeze({ maxNumber: 100, maxGuesses: 7 });
const LIMITS = Object.freeze({ maxNumber: [1, 1_000_000], maxGuesses: [1, 100] });
const OPTION_NAMES = Object.freeze({ max_number: 'maxNumber', max_guesses: 'maxGuesses' });

const SYSTEM_PROMPT =
  'You are playing guess the number. I have picked a secret whole number. ' +
  'Reply with one whole number, your guess. I will tell you whether the secret is higher or ' +
  'lower, until you find it or run out of guesses.';

/** A bad reset option; the server turns it into INVALID_ARGUMENT. */
class GameOptionsError extends Error {}

/** The Reset options (all strings on the wire) as numbers; every problem reported at once. */
function parseOptions(options) {
  const parsed = { ...DEFAULTS };
  const problems = [];
  for (const [key, raw] of Object.entries(options || {})) {
    const field = OPTION_NAMES[key];
    if (field === undefined) {
      problems.push(`unknown option '${key}' (known: ${Object.keys(OPTION_NAMES).join(', ')})`);
      continue;
    }
    const [low, high] = LIMITS[field];
    const value = Number(raw);
    if (!/^[0-9]+$/.test(raw) || value < low || value > high) {
      problems.push(`option ${key}=${JSON.stringify(raw)} must be a whole number in ${low}..${high}`);
      continue;
    }
    parsed[field] = value;
  }
  if (problems.length > 0) throw new GameOptionsError(problems.join('; '));
  return parsed;
}

const MASK_64 = (1n << 64n) - 1n;

/** SplitMix64 of a uint64 seed: a well-mixed uint64, the same everywhere. */
function splitMix64(seed) {
  let z = (BigInt(seed) + 0x9e3779b97f4a7c15n) & MASK_64;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK_64;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & MASK_64;
  return z ^ (z >> 31n);
}

/** The first whole number written in `text` (ASCII digits), or null. */
function firstNumber(text) {
  const match = /[0-9]+/.exec(text);
  return match === null ? null : Number(match[0]);
}

/** One episode of guess the number. */
class GuessTheNumber {
  /**
   * @param {string|number|bigint} seed uint64 (a decimal string, as proto-loader gives it)
   * @param {{[key: string]: string}} options max_number, max_guesses
   */
  constructor(seed, options) {
    const { maxNumber, maxGuesses } = parseOptions(options);
    this.maxNumber = maxNumber;
    this.maxGuesses = maxGuesses;
    this.secret = Number(splitMix64(seed) % BigInt(maxNumber)) + 1;
    this.guesses = 0;
    this.done = false;
  }

  /** The first user message. */
  firstObservation() {
    return (
      `I am thinking of a whole number between 1 and ${this.maxNumber}. ` +
      `You have ${this.maxGuesses} guesses. What is your first guess?`
    );
  }

  /** Apply one reply; returns {observation, reward, done, info} (info values are strings). */
  step(action) {
    if (this.done) throw new Error('the episode is over; reset it to play again');
    this.guesses += 1;
    const left = this.maxGuesses - this.guesses;
    const guess = firstNumber(action);
    const info = { guesses: String(this.guesses) };
    if (guess === this.secret) {
      this.done = true;
      return {
        observation: `Correct! The number was ${this.secret}.`,
        reward: 1.0,
        done: true,
        info: { ...info, outcome: 'win', secret: String(this.secret) },
      };
    }
    if (left <= 0) {
      this.done = true;
      return {
        observation: `Out of guesses. The number was ${this.secret}.`,
        reward: 0.0,
        done: true,
        info: { ...info, outcome: 'loss', secret: String(this.secret) },
      };
    }
    let hint;
    if (guess === null) {
      hint = `I found no number in your reply. Answer with one whole number between 1 and ${this.maxNumber}.`;
    } else if (guess < this.secret) {
      hint = `${guess} is too low. Guess higher.`;
    } else {
      hint = `${guess} is too high. Guess lower.`;
    }
    return {
      observation: `${hint} ${left} ${left === 1 ? 'guess' : 'guesses'} left.`,
      reward: 0.0,
      done: false,
      info: { ...info, outcome: 'playing' },
    };
  }
}

module.exports = { DEFAULTS, SYSTEM_PROMPT, GameOptionsError, GuessTheNumber, firstNumber };
