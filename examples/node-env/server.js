#!/usr/bin/env node
// An OpenTinker environment server in Node.js: guess the number, over gRPC.
//
// It loads the project's .proto files at start-up (no generated code), implements
// opentinker.envhub.v1.EnvironmentService for many concurrent episodes keyed by episode_id,
// and keeps itself registered with EnvHub until SIGTERM/SIGINT, when it deregisters and exits.
// It takes calls only from that EnvHub: every EnvironmentService call must carry the env token
// it registered with (metadata `opentinker-env-token`; see "Authentication" in
// environment.proto), or is answered UNAUTHENTICATED.
//
//   node server.js --envhub 127.0.0.1:50052 [--host 127.0.0.1] [--port 0] [--name guess-number]
//
// Logs are JSON lines on stderr, one event per line.

'use strict';

const crypto = require('node:crypto');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const { DEFAULTS, SYSTEM_PROMPT, GameOptionsError, GuessTheNumber } = require('./game');
const { EnvHubRegistration } = require('./registration');

const HELP = `usage: node server.js --envhub HOST:PORT [options]

  --envhub HOST:PORT       EnvHub to register with (env OPENTINKER_ENVHUB_ADDRESS)
                           the API key comes from the env OPENTINKER_API_KEY (never argv)
  --host HOST              interface to listen on (default 127.0.0.1)
  --port PORT              port to listen on; 0 = any free port (default 0)
  --advertise-host HOST    host EnvHub should dial (default: --host, or 127.0.0.1 for 0.0.0.0)
  --name NAME              environment name (default guess-number)
  --capacity N             concurrent episodes accepted; 0 = unlimited (default 256)
  --idle-timeout-s S       episodes untouched this long are dropped (default 600)
  --protos DIR             root of the .proto files (default: the repository's protos/)
`;

function log(level, event, fields = {}) {
  process.stderr.write(`${JSON.stringify({ time: new Date().toISOString(), level, event, ...fields })}\n`);
}

/** Command-line options, checked; every problem reported at once. */
function readSettings(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      envhub: { type: 'string', default: process.env.OPENTINKER_ENVHUB_ADDRESS || '' },
      host: { type: 'string', default: '127.0.0.1' },
      port: { type: 'string', default: '0' },
      'advertise-host': { type: 'string', default: '' },
      name: { type: 'string', default: 'guess-number' },
      capacity: { type: 'string', default: '256' },
      'idle-timeout-s': { type: 'string', default: '600' },
      protos: { type: 'string', default: path.resolve(__dirname, '..', '..', 'protos') },
      help: { type: 'boolean', default: false },
    },
  });
  if (values.help) {
    process.stdout.write(HELP);
    process.exit(0);
  }
  const problems = [];
  const whole = (key) => {
    const value = Number(values[key]);
    if (!/^[0-9]+$/.test(values[key])) problems.push(`--${key} ${values[key]} must be a whole number >= 0`);
    return value;
  };
  const settings = {
    envhub: values.envhub,
    host: values.host,
    port: whole('port'),
    advertiseHost: values['advertise-host'] || (['0.0.0.0', '::'].includes(values.host) ? '127.0.0.1' : values.host),
    name: values.name,
    capacity: whole('capacity'),
    idleTimeoutMs: Number(values['idle-timeout-s']) * 1000,
    protos: values.protos,
  };
  if (!settings.envhub) problems.push('--envhub (or OPENTINKER_ENVHUB_ADDRESS) is required: the EnvHub to register with');
  if (settings.port > 65535) problems.push(`--port ${settings.port} must be at most 65535`);
  if (!(settings.idleTimeoutMs > 0)) problems.push(`--idle-timeout-s ${values['idle-timeout-s']} must be > 0`);
  if (problems.length > 0) {
    process.stderr.write(`${problems.join('\n')}\n\n${HELP}`);
    process.exit(2);
  }
  return settings;
}

/** The EnvironmentService and EnvHubService definitions, from the .proto files. */
function loadProtos(protosDir) {
  const definition = protoLoader.loadSync(
    ['opentinker/envhub/v1/environment.proto', 'opentinker/envhub/v1/envhub.proto'],
    {
      includeDirs: [protosDir],
      keepCase: true, // field names as in the .proto: episode_id, not episodeId
      longs: String, // uint64 seed arrives as a decimal string, exact
      enums: String,
      defaults: true, // unset fields read as their proto3 defaults
      oneofs: true,
    },
  );
  return grpc.loadPackageDefinition(definition).opentinker.envhub.v1;
}

/** Episodes by id: one game each, dropped when closed or idle for too long. */
class Episodes {
  constructor({ capacity, idleTimeoutMs }) {
    this.capacity = capacity;
    this.idleTimeoutMs = idleTimeoutMs;
    this.byId = new Map(); // episode_id -> {game, touchedMs}
    this.sweeper = setInterval(() => this.dropIdle(), Math.min(idleTimeoutMs, 30_000));
    this.sweeper.unref();
  }

  reset(episodeId, seed, options) {
    if (!this.byId.has(episodeId) && this.capacity > 0 && this.byId.size >= this.capacity) {
      throw Object.assign(new Error(`at capacity: ${this.byId.size} open episodes; close finished ones`), {
        code: grpc.status.RESOURCE_EXHAUSTED,
      });
    }
    const game = new GuessTheNumber(seed, options);
    this.byId.set(episodeId, { game, touchedMs: Date.now() });
    return game;
  }

  get(episodeId) {
    const episode = this.byId.get(episodeId);
    if (episode === undefined) {
      throw Object.assign(new Error(`no episode '${episodeId}' (never reset, closed, or idle too long); reset it first`), {
        code: grpc.status.NOT_FOUND,
      });
    }
    episode.touchedMs = Date.now();
    return episode.game;
  }

  close(episodeId) {
    this.byId.delete(episodeId);
  }

  dropIdle() {
    const cutoff = Date.now() - this.idleTimeoutMs;
    for (const [episodeId, episode] of this.byId) {
      if (episode.touchedMs < cutoff) {
        this.byId.delete(episodeId);
        log('warn', 'episode_dropped_idle', { episode_id: episodeId });
      }
    }
  }
}

const ENV_TOKEN_KEY = 'opentinker-env-token';

/**
 * Why a call does not present `envToken` (null when it does): exactly one value of the
 * metadata key, equal to the token, compared in constant time. Never quotes a token.
 */
function tokenProblem(metadata, envToken) {
  const values = metadata.get(ENV_TOKEN_KEY);
  if (values.length === 0) return `no '${ENV_TOKEN_KEY}' metadata`;
  if (values.length > 1) return `'${ENV_TOKEN_KEY}' metadata sent ${values.length} times`;
  const received = Buffer.from(String(values[0]));
  const expected = Buffer.from(envToken);
  // timingSafeEqual needs equal lengths; the length of a token is no secret.
  if (received.length !== expected.length || !crypto.timingSafeEqual(received, expected)) {
    return `the '${ENV_TOKEN_KEY}' metadata is not this server's env token`;
  }
  return null;
}

/** EnvironmentService handlers: wire messages <-> the game, errors -> status codes. */
function environmentService(settings, episodes, envToken) {
  const spec = {
    name: settings.name,
    description: 'Guess a secret number from higher/lower hints (Node.js example environment).',
    system_prompt: SYSTEM_PROMPT,
    tools: [],
    max_turns: DEFAULTS.maxGuesses,
  };
  // Run a handler once the caller has shown the env token; a thrown error becomes its gRPC
  // status (INTERNAL unless it names one).
  const handle = (body) => (call, callback) => {
    const problem = tokenProblem(call.metadata, envToken);
    if (problem !== null) {
      log('warn', 'env_call_refused', { method: call.getPath(), problem });
      callback({
        code: grpc.status.UNAUTHENTICATED,
        details:
          `environment server '${settings.name}' takes calls only from the EnvHub it registered with: ` +
          `${problem}. Run episodes through EnvHub (RunEpisodes).`,
      });
      return;
    }
    try {
      callback(null, body(call.request));
    } catch (err) {
      let code = Number.isInteger(err.code) ? err.code : grpc.status.INTERNAL;
      if (err instanceof GameOptionsError) code = grpc.status.INVALID_ARGUMENT;
      callback({ code, details: `environment '${settings.name}': ${err.message}` });
    }
  };
  return {
    GetEnvironmentSpec: handle(() => ({ spec })),
    Reset: handle(({ episode_id, seed, options }) => {
      if (!episode_id) throw Object.assign(new Error('episode_id is required'), { code: grpc.status.INVALID_ARGUMENT });
      const game = episodes.reset(episode_id, seed, options);
      return { system_prompt: SYSTEM_PROMPT, observation: game.firstObservation() };
    }),
    Step: handle(({ episode_id, action }) => {
      const game = episodes.get(episode_id);
      if (game.done) {
        throw Object.assign(new Error(`episode '${episode_id}' is over; reset it to play again`), {
          code: grpc.status.FAILED_PRECONDITION,
        });
      }
      return game.step(action);
    }),
    CloseEpisode: handle(({ episode_id }) => {
      episodes.close(episode_id);
      return {};
    }),
  };
}

function bind(server, address) {
  return new Promise((resolve, reject) => {
    server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => (err ? reject(err) : resolve(port)));
  });
}

async function main() {
  const settings = readSettings(process.argv.slice(2));
  const proto = loadProtos(settings.protos);
  const episodes = new Episodes(settings);
  // Made before the server can be reached, kept for its lifetime, sent to EnvHub only.
  const envToken = crypto.randomBytes(32).toString('hex');
  const server = new grpc.Server();
  server.addService(proto.EnvironmentService.service, environmentService(settings, episodes, envToken));
  const port = await bind(server, `${settings.host}:${settings.port}`);
  const address = `${settings.advertiseHost}:${port}`;
  log('info', 'serving', { env: settings.name, address, capacity: settings.capacity });

  const registration = new EnvHubRegistration(proto.EnvHubService, {
    envhubAddress: settings.envhub,
    envName: settings.name,
    address,
    capacity: settings.capacity,
    envToken,
    apiKey: process.env.OPENTINKER_API_KEY || '', // from the environment: argv is visible to `ps`
    log,
  });
  let stopping = false;
  const shutdown = async (signal) => {
    if (stopping) return;
    stopping = true;
    log('info', 'shutting_down', { signal });
    await registration.stop(); // first, so EnvHub routes no new episodes here
    clearInterval(episodes.sweeper);
    const exit = () => {
      log('info', 'stopped');
      process.exit(0);
    };
    // Let calls under way finish, but not for longer than 2 s.
    const forced = setTimeout(() => {
      server.forceShutdown();
      exit();
    }, 2000);
    server.tryShutdown(() => {
      clearTimeout(forced);
      exit();
    });
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));
  await registration.start();
}

main().catch((err) => {
  log('error', 'fatal', { error: err.message });
  process.exit(1);
});
