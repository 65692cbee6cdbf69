(defpackage #:hunchentoot-recycling-websocket
  (:use)
  (:documentation "Websockets served by a parallel acceptor's engine, in
hunchensocket's shape: an application written for hunchensocket is ported
by naming this package instead (see README).  Defined by the package
hunchentoot-recycling-taskmaster, which calls it WS.")
  (:export
   ;; Finding the resource a request opens a websocket on.
   #:*websocket-dispatch-table*
   ;; Resources and their clients.
   #:websocket-resource
   #:websocket-client
   #:clients
   #:client-request
   #:client-subprotocol
   #:client-open-p
   #:origin-allowed-p
   ;; What a resource hears.
   #:client-connected
   #:client-disconnected
   #:text-message-received
   #:binary-message-received
   ;; What any thread may send.
   #:send-text-message
   #:send-binary-message
   #:send-ping
   #:close-connection))

(defpackage #:hunchentoot-recycling-taskmaster
  (:use #:cl)
  (:local-nicknames (#:ws #:hunchentoot-recycling-websocket))
  (:export
   ;; Acceptors: Hunchentoot's four acceptor classes, each with a
   ;; RECYCLING-TASKMASTER as its default taskmaster.
   #:parallel-acceptor
   #:parallel-easy-acceptor
   #:parallel-ssl-acceptor
   #:parallel-easy-ssl-acceptor
   #:abandon-acceptor
   ;; TLS: certificates by host name (SNI), reloaded when replaced; ALPN.
   #:acceptor-ssl-certificates
   #:reload-certificates
   #:acceptor-application-protocols
   #:certificate-not-loaded
   #:refused-certificate-file
   #:refused-key-file
   #:certificate-refusal-reason
   ;; The request and reply classes they use in place of Hunchentoot's defaults.
   #:parallel-request
   #:parallel-reply

   ;; How a parallel acceptor serves connections: the connection engine's
   ;; name and the limits it enforces on the waits and heads of requests.
   #:acceptor-header-timeout
   #:acceptor-keep-alive-timeout
   #:acceptor-queue-timeout
   #:acceptor-reuse-port-p
   #:acceptor-listen-fd
   #:systemd-listen-fd
   #:acceptor-defer-accept-p
   #:acceptor-max-header-bytes
   #:acceptor-max-body-bytes
   #:acceptor-body-buffer-bytes
   #:acceptor-max-websocket-message-bytes
   #:acceptor-max-websocket-queue-bytes
   #:acceptor-websocket-ping-interval
   #:acceptor-websocket-timeout

   ;; The taskmaster and its configuration.
   #:recycling-taskmaster
   #:*default-standby-thread-count*
   #:taskmaster-standby-thread-count
   #:taskmaster-max-waiting-thread-count
   #:taskmaster-thread-idle-timeout
   #:taskmaster-stop-timeout
   #:taskmaster-worker-scheduling-policy

   ;; Sessions kept in a store shared by processes (acceptor-sessions.lisp):
   ;; the protocol a store implements, and the PostgreSQL store (the system
   ;; hunchentoot-recycling-taskmaster/postgresql).
   #:acceptor-session-store
   #:acceptor-session-store-timeout
   #:session-store
   #:stored-session
   #:find-stored-session
   #:add-stored-session
   #:save-stored-session
   #:remove-stored-session
   #:expired-stored-sessions
   #:postgresql-session-store
   #:make-postgresql-session-store
   #:session-store-unavailable
   #:session-value-not-storable

   ;; Replies that wait without a thread (deferred-replies.lisp).
   #:defer-reply
   #:complete-reply
   #:deferred-reply
   #:reply-pending-p
   #:reply-client-gone-p
   #:call-after
   #:cancel-call
   #:start-event-stream
   #:event-stream
   #:send-event
   #:close-event-stream
   #:event-stream-open-p
   #:last-event-id
   #:subscribe
   #:unsubscribe
   #:publish
   #:*channel-bus*
   #:postgresql-channel-bus
   #:make-postgresql-channel-bus
   #:close-channel-bus

   ;; Static files, sent by the kernel.
   #:serve-static-file
   #:create-static-folder-dispatcher-and-handler

   ;; Observing a running pool.
   #:taskmaster-statistics
   #:prometheus-metrics

   ;; Conditions.
   #:recycling-taskmaster-error
   #:recycling-taskmaster-corrupted-error
   #:invalid-configuration
   #:invalid-taskmaster-configuration
   #:invalid-acceptor-configuration
   #:invalid-session-store-configuration
   #:invalid-static-folder
   #:acceptor-not-parallel-error
   #:reply-not-deferrable
   #:event-field-refused
   #:message-too-long
   #:chunked-body-malformed
   #:request-body-too-large
   #:request-body-not-stored
   #:header-value-refused
   #:refused-header-name))
