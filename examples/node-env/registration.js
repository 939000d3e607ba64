// Keep this environment server registered with EnvHub.
//
// Register once (retried while EnvHub is unreachable; a refusal such as INVALID_ARGUMENT is
// fatal), renew on the interval EnvHub returns, register again when a renewal is answered
// NOT_FOUND (the registration expired, or EnvHub restarted), deregister on stop. Every call
// has a deadline, so a dead EnvHub is a logged warning, never a hang. Every call carries the
// API key (metadata `authorization: Bearer <key>`, see identity.proto); the env is then private
// to the key's tenant. Every registration carries the server's env token (the same one each
// time), which EnvHub presents on its calls to the server; it is never logged.

'use strict';

const grpc = require('@grpc/grpc-js');

const CALL_TIMEOUT_MS = 5000;
const DEREGISTER_TIMEOUT_MS = 2000;
const RETRY_MS = 1000;

/** Call a unary method of `client` with the key and a deadline; resolves with the reply. */
function unary(client, method, request, apiKey, timeoutMs = CALL_TIMEOUT_MS) {
  const metadata = new grpc.Metadata();
  if (apiKey) metadata.set('authorization', `Bearer ${apiKey}`);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: Date.now() + timeoutMs }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

const RETRYABLE = new Set([grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED]);

class EnvHubRegistration {
  /**
   * @param {Function} EnvHubService the EnvHubService client constructor (from proto-loader)
   * @param {{envhubAddress: string, envName: string, address: string, capacity: number, envToken: string, apiKey: string, log: Function}} options
   */
  constructor(EnvHubService, { envhubAddress, envName, address, capacity, envToken, apiKey, log }) {
    this.client = new EnvHubService(envhubAddress, grpc.credentials.createInsecure());
    this.apiKey = apiKey;
    this.request = { env_name: envName, address, capacity, env_token: envToken };
    this.envhubAddress = envhubAddress;
    this.log = log;
    this.instanceId = ''; // '' while not registered
    this.renewIntervalMs = 2000;
    this.timer = null;
    this.inFlight = null; // the renewal (or re-registration) under way, if any
    this.stopped = false;
  }

  /** Register now (retrying in the background while EnvHub is unreachable) and keep renewing. */
  async start() {
    try {
      await this.register();
    } catch (err) {
      if (!RETRYABLE.has(err.code)) {
        throw new Error(
          `EnvHub at ${this.envhubAddress} refused the registration of ` +
            `'${this.request.env_name}': ${grpc.status[err.code]}: ${err.details}`,
        );
      }
      this.log('warn', 'envhub_unreachable_retrying', { envhub: this.envhubAddress, code: grpc.status[err.code] });
    }
    this.schedule(this.instanceId ? this.renewIntervalMs : RETRY_MS);
  }

  /** Stop renewing and deregister (best effort, within DEREGISTER_TIMEOUT_MS). */
  async stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    await this.inFlight; // bounded by its call deadline; it may have just registered again
    if (this.instanceId) {
      try {
        await unary(this.client, 'DeregisterEnvironment', { instance_id: this.instanceId }, this.apiKey, DEREGISTER_TIMEOUT_MS);
        this.log('info', 'deregistered', { instance_id: this.instanceId });
      } catch (err) {
        this.log('warn', 'deregister_failed', { code: grpc.status[err.code], details: err.details });
      }
      this.instanceId = '';
    }
    this.client.close();
  }

  async register() {
    const reply = await unary(this.client, 'RegisterEnvironment', this.request, this.apiKey);
    this.instanceId = reply.instance.instance_id;
    if (reply.renew_interval_s > 0) this.renewIntervalMs = reply.renew_interval_s * 1000;
    this.log('info', 'registered', {
      instance_id: this.instanceId,
      envhub: this.envhubAddress,
      address: this.request.address,
      renew_interval_s: this.renewIntervalMs / 1000,
    });
  }

  schedule(delayMs) {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.inFlight = this.tick();
    }, delayMs);
  }

  async tick() {
    try {
      if (this.instanceId) {
        try {
          await unary(this.client, 'RenewRegistration', { instance_id: this.instanceId }, this.apiKey);
        } catch (err) {
          if (err.code !== grpc.status.NOT_FOUND) throw err;
          this.log('info', 'registration_lost_registering_again', { instance_id: this.instanceId });
          this.instanceId = '';
        }
      }
      if (!this.instanceId && !this.stopped) await this.register();
    } catch (err) {
      this.log('warn', 'envhub_call_failed', {
        code: grpc.status[err.code],
        details: err.details,
        registered: Boolean(this.instanceId),
      });
    }
    this.schedule(this.instanceId ? this.renewIntervalMs : RETRY_MS);
  }
}

module.exports = { EnvHubRegistration };
