// Calls one harnessrl RPC from Node with @grpc/grpc-js, over mutual TLS as an identity of the
// deployment (docs/security.md, "Calling harnessrl from another language").
//
//   HARNESSRL_TLS_DIR=.harnessrl/tls/operator node examples/grpc_node/call.mjs \
//       127.0.0.1:PORT Store/ListRuns '{}'
//
// HARNESSRL_TLS_DIR is a folder with ca.crt, tls.crt and tls.key (python -m harnessrl.pki, or a
// mounted Kubernetes TLS Secret). The server is verified as <service>.harnessrl, the name in its
// certificate, whatever address reaches it. Unary RPCs only. Prints the response as JSON; on an
// error prints {"code", "details"} to stderr and exits 2.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PROTOS = path.resolve(HERE, '..', '..', 'protos');
// gRPC service -> the identity that serves it (its certificate names <identity>.harnessrl).
const SERVED_BY = { Store: 'store', Controller: 'controller', GatewayAdmin: 'gateway', Trainer: 'trainer' };

const [address, rpc, body = '{}'] = process.argv.slice(2);
const [service, method] = (rpc ?? '').split('/');
if (!address || !SERVED_BY[service] || !method) {
  console.error(`usage: HARNESSRL_TLS_DIR=DIR node call.mjs HOST:PORT ${Object.keys(SERVED_BY).join('|')}/METHOD [JSON]`);
  process.exit(64);
}
const tlsDir = process.env.HARNESSRL_TLS_DIR;
if (!tlsDir) {
  console.error('HARNESSRL_TLS_DIR must name a folder with ca.crt, tls.crt and tls.key');
  process.exit(64);
}
const read = (name) => fs.readFileSync(path.join(tlsDir, name));

const definition = protoLoader.loadSync(
  fs.readdirSync(path.join(PROTOS, 'harnessrl', 'v1')).map((f) => `harnessrl/v1/${f}`),
  { includeDirs: [PROTOS], keepCase: true, longs: String, enums: String, defaults: true });
const Client = grpc.loadPackageDefinition(definition).harnessrl.v1[service];
const credentials = grpc.credentials.createSsl(read('ca.crt'), read('tls.key'), read('tls.crt'));
const client = new Client(address, credentials, {
  'grpc.ssl_target_name_override': `${SERVED_BY[service]}.harnessrl`,
});
if (typeof client[method] !== 'function' || Client.service[method].responseStream) {
  console.error(`${service}/${method}: no such unary RPC`);
  process.exit(64);
}
client[method](JSON.parse(body), { deadline: Date.now() + 10_000 }, (err, response) => {
  client.close();
  if (err) {
    console.error(JSON.stringify({ code: grpc.status[err.code], details: err.details }));
    process.exit(2);
  }
  console.log(JSON.stringify(response));
});
