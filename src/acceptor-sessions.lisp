;;;; Hunchentoot's session API under a parallel acceptor: sessions in the
;;;; process, as Hunchentoot keeps them, or in the acceptor's SESSION-STORE
;;;; (sessions/session-store.lisp says how a store is used).  Where they live
;;;; is an object, the acceptor's ACCEPTOR-SESSIONS: an IN-PROCESS-SESSIONS or
;;;; the store.  Each of Hunchentoot's session generic functions below asks it
;;;; through one generic function of the protocol that follows, with a
;;;; function that runs the methods after ours.
;;;;
;;;; Under both, a session id is 128 random bits from the kernel (not a
;;;; process-wide counter), and a cookie naming a session with a wrong session
;;;; string is ignored: Hunchentoot removes the session it names, so that
;;;; anyone could log anyone out with a forged cookie (its issue #211).  The
;;;; binding of a session to the client's User-Agent and address is
;;;; Hunchentoot's: *USE-USER-AGENT-FOR-SESSIONS* and
;;;; *USE-REMOTE-ADDR-FOR-SESSIONS* say which.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *session-secret-lock* (bt:make-lock "session secret")
  "Held while HUNCHENTOOT:*SESSION-SECRET* is drawn, so that it is drawn once.")

(defmethod hunchentoot:next-session-id ((acceptor parallel-acceptor))
  "128 random bits from the kernel.  Hunchentoot's session secret, when
still unset, is drawn from the kernel too (Hunchentoot draws it from
RANDOM, with a warning)."
  (unless (boundp 'hunchentoot:*session-secret*)
    (bt:with-lock-held (*session-secret-lock*)
      (unless (boundp 'hunchentoot:*session-secret*)
        (setf hunchentoot:*session-secret* (format nil "~36R" (kernel-random-integer 128))))))
  (kernel-random-integer 128))

;;; Where the sessions live.

(defgeneric check-request-class (sessions request-class)
  (:documentation "Signal INVALID-ACCEPTOR-CONFIGURATION unless requests of
REQUEST-CLASS can find their sessions in SESSIONS."))

(defgeneric find-presented-session (sessions request acceptor id string)
  (:documentation "The session REQUEST presents (its id ID, its session
string STRING) among SESSIONS, or NIL; a wrong STRING leaves that session
alone.  Under a store that does not answer, an UNREACHABLE-SESSION."))

(defgeneric add-new-session (sessions acceptor session next)
  (:documentation "Keep SESSION, just started under ACCEPTOR, in SESSIONS,
calling NEXT (the methods of HUNCHENTOOT:SESSION-CREATED after ours)
where Hunchentoot's own would still run."))

(defgeneric sessions-database (sessions acceptor next)
  (:documentation "What HUNCHENTOOT:SESSION-DB returns for ACCEPTOR; NEXT
returns Hunchentoot's in-process database."))

(defgeneric sessions-database-lock (sessions acceptor next)
  (:documentation "What HUNCHENTOOT:SESSION-DB-LOCK returns for ACCEPTOR;
NEXT returns Hunchentoot's lock."))

(defgeneric replace-sessions-database (sessions acceptor database next)
  (:documentation "Do what (SETF HUNCHENTOOT:SESSION-DB) of DATABASE does
for ACCEPTOR; NEXT sets Hunchentoot's in-process database."))

(defgeneric call-handler-with-sessions (sessions acceptor next)
  (:documentation "Run the request's handler, NEXT (the methods of
HUNCHENTOOT:HANDLE-REQUEST after ours), and what SESSIONS needs around it;
its values."))

(defmacro ask-sessions (function acceptor &rest arguments)
  "Call FUNCTION, a generic function above, with ACCEPTOR's sessions,
ACCEPTOR, ARGUMENTS and NEXT, which runs the methods after the method this
appears in: only within a method's body."
  `(flet ((next () (call-next-method)))
     (declare (dynamic-extent #'next))
     (,function (acceptor-sessions ,acceptor) ,acceptor ,@arguments #'next)))

(defmethod hunchentoot:start :before ((acceptor parallel-acceptor))
  "Refuse to start with a request class that cannot find the acceptor's
sessions (CHECK-REQUEST-CLASS)."
  (check-request-class (acceptor-sessions acceptor) (engine-request-class acceptor)))

;;; Which session a request presents.

(defun presented-session-identifier (request acceptor)
  "The session cookie value REQUEST presents, or its GET parameter of that
name, as Hunchentoot's SESSION-VERIFY looks for them."
  (let ((name (hunchentoot:session-cookie-name acceptor)))
    (or (let ((cookie (hunchentoot:cookie-in name request)))
          (and cookie (url-decoded-cookie cookie)))
        (hunchentoot:get-parameter name request))))

(defun session-bound-to-client-p (session user-agent remote-addr)
  "True when SESSION may serve a client with USER-AGENT and REMOTE-ADDR
under Hunchentoot's bindings of sessions to clients."
  (and (or (not hunchentoot:*use-user-agent-for-sessions*)
           (equal (hunchentoot:session-user-agent session) user-agent))
       (or (not hunchentoot:*use-remote-addr-for-sessions*)
           (equal (hunchentoot:session-remote-addr session) remote-addr))))

(defun find-in-process-session (acceptor id)
  "The session with the integer ID in ACCEPTOR's in-process session
database, through its session index, unless it has expired; an expired one
is removed, as Hunchentoot's own lookup does."
  (let ((session (indexed-session (sessions-index (acceptor-sessions acceptor)) (hunchentoot:session-db acceptor) id)))
    (cond ((and session (hunchentoot:session-too-old-p session))
           (when hunchentoot:*reply*
             (hunchentoot:log-message* :info "Session with ID ~A too old" id))
           (hunchentoot:remove-session session)
           nil)
          (t session))))

(defmethod check-request-class ((sessions in-process-sessions) request-class)
  "Any request class finds in-process sessions: Hunchentoot's own
SESSION-VERIFY knows them."
  (declare (ignore request-class)))

(defmethod find-presented-session ((sessions in-process-sessions) request acceptor id string)
  "REQUEST's session among Hunchentoot's in-process sessions, as
Hunchentoot's SESSION-VERIFY finds it, but a wrong STRING leaves the
session with ID alone."
  (let ((session (find-in-process-session acceptor id)))
    (cond ((null session)
           (hunchentoot:log-message* :info "No session for the session cookie of a request from ~A"
                                     (hunchentoot:remote-addr request))
           nil)
          ((session-string-verified-p session string (hunchentoot:user-agent request)
                                      (hunchentoot:real-remote-addr request))
           (setf (session-last-click session) (get-universal-time))
           session)
          (t
           (hunchentoot:log-message* :warning "A session cookie from ~A does not match its session; ~
the session is left as it was"
                                     (hunchentoot:remote-addr request))
           nil))))

;;; Calls to a store.

(defun call-with-session-store (acceptor function)
  "FUNCTION called with ACCEPTOR's session store, within the acceptor's
SESSION-STORE-TIMEOUT; its values.  A call that does not end in time or
fails signals SESSION-STORE-UNAVAILABLE."
  (let ((store (acceptor-session-store acceptor))
        (seconds (acceptor-session-store-timeout acceptor))
        (started (get-internal-real-time)))
    (handler-bind ((session-store-unavailable
                     (lambda (condition) (note-session-store-failed store condition started))))
      (multiple-value-prog1
          (handler-case (with-deadline (seconds)
                          (funcall function store))
            (deadline-passed ()
              (error 'session-store-unavailable
                     :store store :reason (format nil "no answer within ~A s" seconds))))
        (note-session-store-answered store started)))))

(defmacro with-session-store ((store acceptor) &body body)
  "Run BODY with STORE bound to ACCEPTOR's session store, as CALL-WITH-SESSION-STORE."
  `(call-with-session-store ,acceptor (lambda (,store) ,@body)))

(defmethod check-request-class ((store session-store) request-class)
  "Only a PARALLEL-REQUEST finds a store's sessions: Hunchentoot's own
SESSION-VERIFY knows only its in-process ones."
  (unless (subtypep request-class 'parallel-request)
    (error 'invalid-acceptor-configuration
           :initarg :request-class :value request-class
           :reason "must inherit from PARALLEL-REQUEST where sessions are in a :SESSION-STORE")))

(defmethod find-presented-session ((store session-store) request acceptor id string)
  "REQUEST's session in STORE: the STORED-SESSION with ID and STRING bound
to this client, NIL when there is none, or an UNREACHABLE-SESSION when the
store does not answer."
  (handler-case
      (let ((session (with-session-store (store acceptor)
                       (find-stored-session store id string (get-universal-time)))))
        (cond ((null session)
               (hunchentoot:log-message* :info "No session for the session cookie of a request from ~A"
                                         (hunchentoot:remote-addr request))
               nil)
              ((session-bound-to-client-p session (hunchentoot:user-agent request)
                                          (hunchentoot:real-remote-addr request))
               session)
              (t
               (hunchentoot:log-message* :warning "A session cookie from ~A was sent by another client ~
than its session's; the session is left as it was"
                                         (hunchentoot:remote-addr request))
               nil)))
    (session-store-unavailable ()
      (make-unreachable-session store id string))))

(defmethod hunchentoot:session-verify ((request parallel-request))
  "REQUEST's session, from its cookie (or the GET parameter of that name),
in its acceptor's store or in the process."
  (let ((acceptor (hunchentoot:request-acceptor request)))
    (if (not (typep acceptor 'parallel-acceptor))
        (call-next-method)
        (multiple-value-bind (id string)
            (parse-session-identifier (presented-session-identifier request acceptor))
          (when id
            (find-presented-session (acceptor-sessions acceptor) request acceptor id string))))))

(sb-ext:defglobal **new-sessions** (list 0)
  "In its car, the sessions started under parallel acceptors without a
store, counted as Hunchentoot counts new sessions for SESSION-GC.")

(defun collect-expired-sessions-when-due (acceptor)
  "Hunchentoot's SESSION-CREATED: every *SESSION-GC-FREQUENCY* new
sessions, HUNCHENTOOT:SESSION-GC, unless ACCEPTOR's session index knows that
it would find no session too old."
  (let ((frequency hunchentoot:*session-gc-frequency*)
        (index (sessions-index (acceptor-sessions acceptor))))
    (when (and frequency
               (zerop (mod (1+ (sb-ext:atomic-incf (car **new-sessions**))) frequency))
               (sessions-may-have-expired-p index (hunchentoot:session-db acceptor) (get-universal-time)))
      (hunchentoot:session-gc)
      (note-sessions-collected index (hunchentoot:session-db acceptor)))))

(sb-ext:defglobal **session-created-chain** nil
  "The last answer of ONLY-HUNCHENTOOT-COUNTING-FOLLOWS-P: a list of
HUNCHENTOOT:SESSION-CREATED's methods list, the acceptor's and the session's
classes, and the answer for them.")

(defun only-hunchentoot-counting-follows-p (acceptor session)
  "True when the primary methods of HUNCHENTOOT:SESSION-CREATED that follow
ours for ACCEPTOR and SESSION are Hunchentoot's own counting of new sessions
alone, which COLLECT-EXPIRED-SESSIONS-WHEN-DUE then does in its place."
  (let ((methods (generic-function-methods-list #'hunchentoot:session-created))
        (acceptor-class (class-of acceptor))
        (session-class (class-of session))
        (last **session-created-chain**))
    (if (and last (eq (first last) methods) (eq (second last) acceptor-class) (eq (third last) session-class))
        (fourth last)
        (let* ((generic-function #'hunchentoot:session-created)
               (ours (find-method generic-function '() (list (find-class 'parallel-acceptor)
                                                             (find-class 'hunchentoot:session))))
               (hunchentoot-counting (find-method generic-function '() (list (find-class t) (find-class t))))
               (answer (equal (primary-methods-after ours generic-function (list acceptor session))
                              (list hunchentoot-counting))))
          (setf **session-created-chain** (list methods acceptor-class session-class answer))
          answer))))

;;; Hunchentoot's session database.

(defmethod hunchentoot:session-created ((acceptor parallel-acceptor) (session hunchentoot:session))
  "Keep the new SESSION where ACCEPTOR's sessions live (ADD-NEW-SESSION)."
  (ask-sessions add-new-session acceptor session))

(defmethod add-new-session ((sessions in-process-sessions) acceptor session next)
  "Make SESSION an IN-PROCESS-SESSION, which the session index can tell has
been removed, and count it as Hunchentoot does, its SESSION-GC skipped
while the index knows it would remove nothing."
  (when (eq (class-of session) (find-class 'hunchentoot:session))
    (change-class session 'in-process-session))
  (if (only-hunchentoot-counting-follows-p acceptor session)
      (collect-expired-sessions-when-due acceptor)
      ;; A mixin's method after ours runs as it would; Hunchentoot's
      ;; counting then runs at the end of the chain as it would.
      (funcall next)))

(defmethod add-new-session ((store session-store) acceptor session next)
  "Make SESSION a STORED-SESSION and add it to STORE before Hunchentoot's
own counting of new sessions for SESSION-GC."
  (change-class session 'stored-session)
  ;; Before the store writes them: when it cannot, the request is answered
  ;; 503 and its session goes with it.
  (setf (stored-fields session) (session-stored-fields session))
  (with-session-store (store acceptor)
    (add-stored-session store session))
  (funcall next))

(defmethod hunchentoot:acceptor-remove-session ((acceptor parallel-acceptor) (session stored-session))
  "Remove SESSION from the store, then call the methods after this one."
  (with-session-store (store acceptor)
    (remove-stored-session store session))
  (setf (stored-session-removed-p session) t)
  (call-next-method))

(defmethod hunchentoot:session-db ((acceptor parallel-acceptor))
  "What ACCEPTOR's sessions make of it (SESSIONS-DATABASE)."
  (ask-sessions sessions-database acceptor))

(defmethod sessions-database ((sessions in-process-sessions) acceptor next)
  "Hunchentoot's in-process database."
  (declare (ignore acceptor))
  (funcall next))

(defmethod sessions-database ((store session-store) acceptor next)
  "STORE's expired sessions, which Hunchentoot's SESSION-GC then removes one
by one (its ACCEPTOR-REMOVE-SESSION methods run for each); a session
Hunchentoot would add or look up here is the store's business."
  (declare (ignore next))
  (mapcar (lambda (session) (cons (hunchentoot:session-id session) session))
          (with-session-store (store acceptor)
            (expired-stored-sessions store (get-universal-time)))))

(defmethod hunchentoot:session-db-lock ((acceptor parallel-acceptor) &key (whole-db-p t))
  "What ACCEPTOR's sessions make of it (SESSIONS-DATABASE-LOCK)."
  (declare (ignore whole-db-p))
  (ask-sessions sessions-database-lock acceptor))

(defmethod sessions-database-lock ((sessions in-process-sessions) acceptor next)
  "Hunchentoot's lock."
  (declare (ignore acceptor))
  (funcall next))

(defmethod sessions-database-lock ((store session-store) acceptor next)
  "None: each request has its own copy of its session, and the store guards
itself."
  (declare (ignore acceptor next))
  nil)

(defmethod (setf hunchentoot:session-db) (database (acceptor parallel-acceptor))
  "What ACCEPTOR's sessions make of it (REPLACE-SESSIONS-DATABASE)."
  (ask-sessions replace-sessions-database acceptor database))

(defmethod replace-sessions-database ((sessions in-process-sessions) acceptor database next)
  "Hunchentoot's in-process database becomes DATABASE."
  (declare (ignore acceptor database))
  (funcall next))

(defmethod replace-sessions-database ((store session-store) acceptor database next)
  "Nothing: the store is the database."
  (declare (ignore acceptor next))
  database)

;;; A request's session written back.

(defun save-request-session (acceptor)
  "Write the current request's session back to ACCEPTOR's store when its
handler changed it."
  (let ((session hunchentoot:*session*))
    (when (and (typep session 'stored-session)
               (not (stored-session-removed-p session)))
      (let ((fields (session-stored-fields session)))
        (unless (equal fields (stored-fields session))
          ;; Before the store writes them, as in SESSION-CREATED.
          (setf (stored-fields session) fields)
          (with-session-store (store acceptor)
            (save-stored-session store session)))))))

(defun session-store-unavailable-reply (acceptor)
  "The 503 a request gets when its session's store is unavailable."
  (note-session-store-refused (acceptor-session-store acceptor))
  (setf (hunchentoot:return-code*) hunchentoot:+http-service-unavailable+
        (hunchentoot:header-out :retry-after) "1")
  (hunchentoot:acceptor-status-message acceptor hunchentoot:+http-service-unavailable+))

(defmethod hunchentoot:handle-request :around ((acceptor parallel-acceptor) (request hunchentoot:request))
  "Run the handler as ACCEPTOR's sessions need (CALL-HANDLER-WITH-SESSIONS)."
  (ask-sessions call-handler-with-sessions acceptor))

(defmethod call-handler-with-sessions ((sessions in-process-sessions) acceptor next)
  "The handler alone: an in-process session is changed where it lives."
  (declare (ignore acceptor))
  (funcall next))

(defmethod call-handler-with-sessions ((store session-store) acceptor next)
  "Write the request's session back after its handler returns or ends early
(HUNCHENTOOT:REDIRECT, ABORT-REQUEST-HANDLER), not after an error; answer
503 when STORE is unavailable, and 500 for a session value it cannot keep."
  (handler-case
      (multiple-value-bind (contents error backtrace)
          (catching-handler-end (funcall next))
        (unless error
          (save-request-session acceptor))
        (values contents error backtrace))
    (session-store-unavailable ()
      (session-store-unavailable-reply acceptor))
    (session-value-not-storable (condition)
      (values nil condition nil))))
