;;;; Websockets served by the engine, over the wire: the handshake, the
;;;; frame cases the Autobahn suite checks, each against RFC 6455's answer,
;;;; sends from other threads, the limits, the pings, and STOP.  The client
;;;; is a raw socket that writes masked frames octet by octet as told.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite websockets :in all :description "Websockets that hold no thread.")
(in-suite websockets)

;;; Resources of the tests.

(defclass echo-websocket-resource (ws:websocket-resource) ()
  (:documentation "Each message back to its sender, text as text, binary as binary."))

(defmethod ws:text-message-received ((resource echo-websocket-resource) client message)
  (if (string= message "fail")
      (error "The handler fails on purpose.")
      (ws:send-text-message client message)))

(defmethod ws:binary-message-received ((resource echo-websocket-resource) client octets)
  (ws:send-binary-message client octets))

(defclass chat-websocket-resource (ws:websocket-resource) ()
  (:documentation "Each text message to every client."))

(defmethod ws:text-message-received ((resource chat-websocket-resource) client message)
  (declare (ignore client))
  (dolist (peer (ws:clients resource))
    (ws:send-text-message peer message)))

(defvar *echo* (make-instance 'echo-websocket-resource :subprotocols '("echo.v2" "echo.v1")
                                               :origins '("http://allowed.example")))

(defvar *chat* (make-instance 'chat-websocket-resource))

(defclass slow-echo-websocket-resource (ws:websocket-resource) ()
  (:documentation "Each text message back to its sender a moment after it
came, the handler's start told by *SLOW-ECHO-STARTED*."))

(defvar *slow-echo-started* (sb-thread:make-semaphore)
  "Signalled as a slow echo's handler begins.")

(defmethod ws:text-message-received ((resource slow-echo-websocket-resource) client message)
  (sb-thread:signal-semaphore *slow-echo-started*)
  (sleep 0.2)
  (ws:send-text-message client message))

(defvar *slow-echo* (make-instance 'slow-echo-websocket-resource))

(defun find-test-resource (request)
  (let ((path (ht:script-name request)))
    (cond ((string= path "/echo") *echo*)
          ((string= path "/chat") *chat*)
          ((string= path "/slow-echo") *slow-echo*))))

(pushnew 'find-test-resource ws:*websocket-dispatch-table*)

(defun websocket-server (&rest initargs)
  (apply #'make-server 'parallel-easy-acceptor initargs))

;;; A client.

(defun websocket-handshake-text (path &key (key "dGhlIHNhbXBsZSBub25jZQ==") (version "13") protocol origin user-agent
                                            extensions)
  (apply #'crlf-lines
         (remove nil (list (format nil "GET ~A HTTP/1.1" path)
                           "Host: 127.0.0.1" "Upgrade: websocket" "Connection: Upgrade"
                           (format nil "Sec-WebSocket-Key: ~A" key)
                           (format nil "Sec-WebSocket-Version: ~A" version)
                           (and protocol (format nil "Sec-WebSocket-Protocol: ~A" protocol))
                           (and origin (format nil "Origin: ~A" origin))
                           (and user-agent (format nil "User-Agent: ~A" user-agent))
                           (and extensions (format nil "Sec-WebSocket-Extensions: ~A" extensions))
                           ""))))

(defun read-reply-head (socket &key (timeout 10))
  "The status and head (a string) of a reply without a body."
  (let ((stream (usocket:socket-stream socket))
        (octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
        (deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second))))
    (loop until (search #(13 10 13 10) octets)
          do (when (> (get-internal-real-time) deadline) (return-from read-reply-head nil))
             (when (usocket:wait-for-input socket :timeout 0.1 :ready-only t)
               (let ((byte (read-byte stream nil)))
                 (if byte (vector-push-extend byte octets) (return-from read-reply-head nil)))))
    (let ((text (flex:octets-to-string octets :external-format :latin-1)))
      (values (parse-integer text :start 9 :end 12) text))))

(defun open-websocket (server path &rest handshake-args)
  "A socket whose websocket on PATH is open, and the 101's head; or NIL and the status."
  (let ((socket (connect server)))
    (send-text socket (apply #'websocket-handshake-text path handshake-args))
    (multiple-value-bind (status head) (read-reply-head socket)
      (if (eql status 101)
          (values socket head)
          (progn (usocket:socket-close socket) (values nil status head))))))

(defun frame (opcode payload &key (fin t) (rsv 0) (mask #x37fa213d) (length (length payload)))
  "The octets of a client frame, masked with MASK unless it is NIL."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
    (vector-push-extend (logior (if fin #x80 0) (ash rsv 4) opcode) out)
    (let ((mask-bit (if mask #x80 0)))
      (cond ((<= length 125) (vector-push-extend (logior mask-bit length) out))
            ((<= length #xFFFF) (vector-push-extend (logior mask-bit 126) out)
             (vector-push-extend (ldb (byte 8 8) length) out) (vector-push-extend (ldb (byte 8 0) length) out))
            (t (vector-push-extend (logior mask-bit 127) out)
               (loop for shift from 56 downto 0 by 8 do (vector-push-extend (ldb (byte 8 shift) length) out)))))
    (when mask
      (loop for shift from 24 downto 0 by 8 do (vector-push-extend (ldb (byte 8 shift) mask) out)))
    (loop for octet across payload
          for index from 0
          do (vector-push-extend (if mask (logxor octet (ldb (byte 8 (* 8 (- 3 (mod index 4)))) mask)) octet) out))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun send-octets (socket octets)
  (let ((stream (usocket:socket-stream socket)))
    (write-sequence octets stream)
    (finish-output stream)))

(defun send-frame (socket opcode payload &rest frame-args)
  (send-octets socket (apply #'frame opcode (if (stringp payload) (text-octets payload) payload) frame-args)))

(defun read-exactly (socket count deadline)
  (let ((octets (make-array count :element-type '(unsigned-byte 8)))
        (stream (usocket:socket-stream socket)))
    (dotimes (index count octets)
      (loop until (or (ignore-errors (listen stream)) (usocket:wait-for-input socket :timeout 0.1 :ready-only t))
            do (when (> (get-internal-real-time) deadline) (return-from read-exactly nil)))
      (let ((octet (ignore-errors (read-byte stream nil))))
        (unless octet (return-from read-exactly nil))
        (setf (aref octets index) octet)))))

(defun read-frame (socket &key (timeout 10))
  "The opcode, payload, FIN, MASK and RSV1 of the next frame the server
sent; NIL at the end of the connection or after TIMEOUT seconds."
  (let* ((deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second)))
         (head (read-exactly socket 2 deadline)))
    (when head
      (let* ((short (ldb (byte 7 0) (aref head 1)))
             (length (case short
                       (126 (let ((o (read-exactly socket 2 deadline))) (and o (+ (ash (aref o 0) 8) (aref o 1)))))
                       (127 (let ((o (read-exactly socket 8 deadline)))
                              (and o (reduce (lambda (a b) (+ (ash a 8) b)) o))))
                       (t short)))
             (payload (and length (read-exactly socket length deadline))))
        (when payload
          (values (ldb (byte 4 0) (aref head 0)) payload (logbitp 7 (aref head 0)) (logbitp 7 (aref head 1))
                  (logbitp 6 (aref head 0))))))))

(defun read-text (socket &key (timeout 10))
  "The next text message's string, or the opcode of another frame."
  (multiple-value-bind (opcode payload) (read-frame socket :timeout timeout)
    (if (eql opcode 1) (flex:octets-to-string payload :external-format :utf-8) opcode)))

(defun close-code (payload)
  (and payload (>= (length payload) 2) (+ (ash (aref payload 0) 8) (aref payload 1))))

(defun read-close (socket &key (timeout 10))
  "The code of the close frame the server sends next, skipping other
frames; :NONE for a close without a code; NIL when none came."
  (loop (multiple-value-bind (opcode payload) (read-frame socket :timeout timeout)
          (cond ((null opcode) (return nil))
                ((= opcode 8) (return (or (close-code payload) :none)))))))

(defun head-has-p (head line)
  "True when HEAD has the header LINE, its name in any case."
  (search line head :test #'char-equal))

(defun failed-with-p (socket code)
  "True when the server sends a close frame with CODE, then closes the connection."
  (and (eql code (read-close socket)) (closed-by-server-p socket)))

(defmacro with-websocket ((socket server path &rest handshake-args) &body body)
  `(let ((,socket (open-websocket ,server ,path ,@handshake-args)))
     (is (not (null ,socket)) "the handshake was answered 101")
     (when ,socket
       (unwind-protect (progn ,@body)
         (usocket:socket-close ,socket)))))

;;; The handshake.

(test websockets.handshake-answers-101-with-accept-and-no-body
  (with-server (server (websocket-server))
    (multiple-value-bind (socket head) (open-websocket server "/chat")
      (is (not (null socket)))
      (when socket
        (usocket:socket-close socket)
        (is (head-has-p head "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="))
        (is (head-has-p head "Upgrade: websocket"))
        (is (head-has-p head "Connection: Upgrade"))
        (is (not (head-has-p head "Content-Length")) "a 1xx has no Content-Length")
        (is (not (head-has-p head "Content-Type")))))))

(test websockets.handshake-refusals
  (with-server (server (websocket-server))
    (is (eql 426 (nth-value 1 (open-websocket server "/chat" :version "8"))))
    (is (eql 400 (nth-value 1 (open-websocket server "/chat" :key "tooshort"))))
    (is (eql 403 (nth-value 1 (open-websocket server "/echo" :origin "http://evil.example"))))
    (is (eql 404 (nth-value 1 (open-websocket server "/nowhere"))) "no resource: dispatched as any request")
    (is (eql 404 (http-get server "/chat")) "a request without Upgrade is dispatched as any request")))

(test websockets.subprotocol-chosen-in-the-resource-order
  (with-server (server (websocket-server))
    (multiple-value-bind (socket head) (open-websocket server "/echo" :protocol "echo.v1, echo.v2"
                                                                      :origin "http://allowed.example")
      (is (head-has-p head "Sec-WebSocket-Protocol: echo.v2"))
      (when socket (usocket:socket-close socket)))))

;;; Framing (Autobahn 1.x), as RFC 6455 5 says.

(test websockets.echoes-text-and-binary-of-every-length-class
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (dolist (length '(0 1 125 126 127 65535 65536 300000))
        (let ((text (make-string length :initial-element #\x)))
          (send-frame socket 1 text)
          (is (equal text (read-text socket)) "text of ~D octets" length)))
      (let ((octets (coerce (loop for i below 70000 collect (mod i 256)) '(simple-array (unsigned-byte 8) (*)))))
        (send-frame socket 2 octets)
        (multiple-value-bind (opcode payload fin masked) (read-frame socket)
          (is (eql 2 opcode))
          (is (equalp octets payload))
          (is-true fin)
          (is-false masked "the server never masks"))))))

(test websockets.message-split-into-one-octet-writes
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (let ((octets (concatenate '(vector (unsigned-byte 8))
                                 (frame 1 (text-octets "héllo ") :fin nil)
                                 (frame 9 (text-octets "p"))
                                 (frame 0 (text-octets "wörld")))))
        (loop for octet across octets
              do (send-octets socket (vector octet)))
        (multiple-value-bind (opcode payload) (read-frame socket)
          (is (eql 10 opcode) "the ping between fragments is answered first")
          (is (equalp (text-octets "p") payload)))
        (is (equal "héllo wörld" (read-text socket)))))))

;;; Pings and pongs (Autobahn 2.x).

(test websockets.pings-answered-with-their-payload
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (send-frame socket 9 (text-octets "Hello, world!"))
      (multiple-value-bind (opcode payload) (read-frame socket)
        (is (eql 10 opcode))
        (is (equalp (text-octets "Hello, world!") payload)))
      (send-frame socket 10 (text-octets "unasked"))
      (dotimes (i 10) (send-frame socket 9 (vector i)))
      (dotimes (i 10)
        (multiple-value-bind (opcode payload) (read-frame socket)
          (is (and (eql 10 opcode) (equalp (vector i) payload)) "pong ~D, the unasked pong ignored" i))))))

(test websockets.ping-over-125-octets-fails-with-1002
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (send-frame socket 9 (make-array 126 :element-type '(unsigned-byte 8)))
      (is (failed-with-p socket 1002)))))

;;; Reserved bits, opcodes, masking (Autobahn 3.x, 4.x).

(test websockets.reserved-bits-opcodes-and-unmasked-frames-fail-with-1002
  (with-server (server (websocket-server))
    (loop for (description . frame-args) in '(("RSV1" 1 "x" :rsv 4) ("RSV2" 1 "x" :rsv 2) ("RSV3" 1 "x" :rsv 1)
                                              ("opcode 3" 3 "x") ("opcode 7" 7 "x") ("opcode 11" 11 "x")
                                              ("opcode 15" 15 "x") ("unmasked" 1 "x" :mask nil))
          do (with-websocket (socket server "/echo")
               (send-frame socket 1 "before")
               (is (equal "before" (read-text socket)))
               (apply #'send-frame socket frame-args)
               (is (failed-with-p socket 1002) "~A" description)))))

;;; Fragmentation (Autobahn 5.x).

(test websockets.fragments-joined-and-misordered-ones-refused
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 "frag" :fin nil)
      (send-frame socket 0 "men" :fin nil)
      (send-frame socket 0 "ted")
      (is (equal "fragmented" (read-text socket))))
    (with-websocket (socket server "/echo")
      (send-frame socket 0 "no start")
      (is (failed-with-p socket 1002) "a continuation outside a message"))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 "one" :fin nil)
      (send-frame socket 1 "two")
      (is (failed-with-p socket 1002) "a new message inside one"))
    (with-websocket (socket server "/echo")
      (send-frame socket 9 "p" :fin nil)
      (is (failed-with-p socket 1002) "a fragmented ping"))))

;;; UTF-8 (Autobahn 6.x).

(test websockets.utf-8-text-checked-fast
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 "κόσμε – ∮ E⋅da = Q 😀")
      (is (equal "κόσμε – ∮ E⋅da = Q 😀" (read-text socket))))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 (coerce '(#xCE #xBA #xED #xA0 #x80) '(vector (unsigned-byte 8))))
      (is (failed-with-p socket 1007) "a surrogate"))
    (with-websocket (socket server "/echo")
      ;; Autobahn 6.4.1: the first fragment is already invalid; the rest never comes.
      (send-frame socket 1 (coerce '(#xCE #xBA #xF4 #x90 #x80 #x80) '(vector (unsigned-byte 8))) :fin nil)
      (is (failed-with-p socket 1007) "failed before the message ends"))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 (coerce '(#x41 #xE2 #x82) '(vector (unsigned-byte 8))))
      (is (failed-with-p socket 1007) "a message ending in the middle of a character"))))

;;; Closing (Autobahn 7.x).

(test websockets.close-codes-echoed-and-bad-ones-refused
  (with-server (server (websocket-server))
    (loop for (payload expected description)
            in `((,(vector 3 232) 1000 "1000 echoed")
                 (,(vector 11 184) 3000 "3000 echoed")
                 (,(concatenate 'vector (vector 3 233) (text-octets "gone")) 1001 "a reason")
                 (#() 1000 "no code: 1000")
                 (,(vector 3) 1002 "one octet")
                 (,(vector 3 237) 1002 "1005 may not be sent")
                 (,(vector 3 231) 1002 "999")
                 (,(vector 3 232 #xC0 #x80) 1007 "a reason not UTF-8"))
          do (with-websocket (socket server "/echo")
               (send-frame socket 8 (coerce payload '(vector (unsigned-byte 8))))
               (is (failed-with-p socket expected) "~A" description)))
    (with-websocket (socket server "/echo")
      (send-frame socket 8 (vector 3 232))
      (send-frame socket 1 "after the close")
      (is (eql 1000 (read-close socket)))
      (is (closed-by-server-p socket) "nothing answered after the close"))))

(test websockets.close-from-the-server-waits-for-the-client
  (with-server (server (websocket-server))
    (with-websocket (socket server "/chat")
      (is (wait-until (lambda () (= 1 (length (ws:clients *chat*))))))
      (ws:close-connection (first (ws:clients *chat*)) :status 4000 :reason "done")
      (multiple-value-bind (opcode payload) (read-frame socket)
        (is (eql 8 opcode))
        (is (eql 4000 (close-code payload))))
      (send-frame socket 8 (vector 15 160))
      (is (closed-by-server-p socket))
      (is (wait-until (lambda () (null (ws:clients *chat*))))))))

;;; Limits (Autobahn 9.x).

(test websockets.message-over-the-limit-fails-with-1009
  (with-server (server (websocket-server :max-websocket-message-bytes 1000))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 (make-string 1000 :initial-element #\a))
      (is (= 1000 (length (read-text socket))))
      (send-frame socket 1 (make-string 600 :initial-element #\a) :fin nil)
      (send-frame socket 0 (make-string 600 :initial-element #\a))
      (is (failed-with-p socket 1009)))))

;;; hunchensocket's chat demo, ported as README shows.

(defclass chat-room (ws:websocket-resource)
  ((name :initarg :name :reader room-name))
  (:default-initargs :client-class 'chat-user))

(defclass chat-user (ws:websocket-client)
  ((name :initarg :user-agent :reader user-name :initform (error "Name this user!"))))

(defvar *chat-rooms* (list (make-instance 'chat-room :name "/bongo")))

(defun find-chat-room (request)
  (find (ht:script-name request) *chat-rooms* :test #'string= :key #'room-name))

(pushnew 'find-chat-room ws:*websocket-dispatch-table*)

(defun broadcast (room message &rest args)
  (loop for peer in (ws:clients room)
        do (ws:send-text-message peer (apply #'format nil message args))))

(defmethod ws:client-connected ((room chat-room) user)
  (broadcast room "~a has joined ~a" (user-name user) (room-name room)))

(defmethod ws:client-disconnected ((room chat-room) user)
  (broadcast room "~a has left ~a" (user-name user) (room-name room)))

(defmethod ws:text-message-received ((room chat-room) user message)
  (broadcast room "~a says ~a" (user-name user) message))

(test websockets.hunchensocket-chat-demo-ported-by-renaming
  (with-server (server (make-server 'parallel-acceptor))
    (with-websocket (alice server "/bongo" :user-agent "alice")
      (is (equal "alice has joined /bongo" (read-text alice)))
      (with-websocket (bob server "/bongo" :user-agent "bob")
        (is (equal "bob has joined /bongo" (read-text alice)))
        (is (equal "bob has joined /bongo" (read-text bob)))
        (send-frame alice 1 "hi")
        (is (equal "alice says hi" (read-text alice)))
        (is (equal "alice says hi" (read-text bob)))
        (send-frame bob 8 (vector 3 232))
        (is (eql 1000 (read-close bob))))
      (is (equal "bob has left /bongo" (read-text alice))))
    (is (eql 500 (nth-value 1 (open-websocket server "/bongo")))
        "a client that cannot be made fails the handshake as a handler's error")))

;;; Handlers.

(test websockets.handler-error-logged-and-closed-with-1011
  (with-server (server (websocket-server))
    (with-websocket (socket server "/echo")
      (send-frame socket 1 "fail")
      (is (failed-with-p socket 1011)))
    (is (eql 404 (http-get server "/chat")) "the worker serves on")))

(test websockets.resource-without-binary-method-closes-with-1003
  (with-server (server (websocket-server))
    (with-websocket (socket server "/chat")
      (send-frame socket 2 (vector 1 2 3))
      (is (eql 1003 (read-close socket)))
      (send-frame socket 8 (vector 3 235))
      (is (closed-by-server-p socket) "closed once the client's close frame came"))))

(test websockets.broadcast-from-any-thread-reaches-every-client
  (with-server (server (websocket-server))
    (let ((sockets (loop repeat 20 collect (open-websocket server "/chat"))))
      (unwind-protect
           (progn
             (is (every #'identity sockets))
             (is (wait-until (lambda () (= 20 (length (ws:clients *chat*))))))
             (funcall (in-thread (lambda () (dolist (client (ws:clients *chat*))
                                                (ws:send-text-message client "from another thread")))))
             (is (every (lambda (socket) (equal "from another thread" (read-text socket))) sockets))
             (send-frame (first sockets) 1 "hello all")
             (is (every (lambda (socket) (equal "hello all" (read-text socket))) sockets)))
        (mapc #'usocket:socket-close (remove nil sockets))))
    (is (wait-until (lambda () (null (ws:clients *chat*)))))))

(test websockets.idle-websockets-hold-no-worker
  (with-server (server (make-server 'parallel-easy-acceptor
                                    :taskmaster (make-instance 'recycling-taskmaster :max-thread-count 4
                                                                                     :standby-thread-count 2)))
    (let ((sockets (loop repeat 50 collect (open-websocket server "/echo"))))
      (unwind-protect
           (progn
             (is (every #'identity sockets) "50 websockets open on 4 workers")
             ;; The server counts a websocket once its 101 is sent: the
             ;; client may read the 101 first.
             (is (wait-until (lambda () (eql 50 (stats server :open-websockets))))
                 "~D websockets counted open, not 50" (stats server :open-websockets))
             (is (eql 404 (http-get server "/chat")) "a plain request is answered meanwhile")
             (loop for socket in sockets
                   for i from 0
                   do (send-frame socket 1 (format nil "~D" i)))
             (is (loop for socket in sockets
                       for i from 0
                       always (equal (format nil "~D" i) (read-text socket)))))
        (mapc #'usocket:socket-close (remove nil sockets))))
    (is (wait-until (lambda () (eql 0 (stats server :open-websockets)))))))

;;; Pings, timeouts, clients that do not read.

(test websockets.silent-client-pinged-then-closed-with-1001
  (with-server (server (websocket-server :websocket-ping-interval 1/2 :websocket-timeout 3/2))
    (with-websocket (socket server "/echo")
      (is (eql 9 (read-frame socket :timeout 5)) "pinged after the interval")
      (send-frame socket 10 #())
      (is (eql 9 (read-frame socket :timeout 5)) "pinged again after the pong")
      (is (eql 1001 (read-close socket :timeout 5)) "closed once silent for the timeout")
      (is (closed-by-server-p socket)))))

(test websockets.client-that-reads-nothing-closed-with-1008
  (with-server (server (websocket-server :max-websocket-queue-bytes 100000))
    (with-websocket (socket server "/chat")
      (is (wait-until (lambda () (= 1 (length (ws:clients *chat*))))))
      (let ((client (first (ws:clients *chat*)))
            (message (make-string 10000 :initial-element #\z)))
        (is (loop repeat 10000
                  thereis (not (ws:send-text-message client message)))
            "a send finds the queue full, without waiting")
        (is (wait-until (lambda () (null (ws:clients *chat*)))) "the client is closed")
        (is (eql 1 (cdr (assoc 1008 (stats server :websocket-closes)))))))))

;;; STOP.

(test websockets.stop-closes-each-websocket-with-1001
  (dolist (soft '(t nil))
    (with-thread-leak-check ()
      (let ((server (websocket-server)))
        (ht:start server)
        (let ((sockets (loop repeat 5 collect (open-websocket server "/echo"))))
          (unwind-protect
               (progn
                 (is (every #'identity sockets))
                 (send-frame (first sockets) 1 "x")
                 (is (equal "x" (read-text (first sockets))))
                 ;; A soft STOP also lets a handshake under way end; a hard
                 ;; one cuts it as any request in flight.
                 (unless soft
                   (is (wait-until (lambda () (eql 5 (stats server :open-websockets))))))
                 (ht:stop server :soft soft)
                 (is (every (lambda (socket) (eql 1001 (read-close socket))) sockets)
                     "~:[hard~;soft~] STOP: a close frame 1001 on each" soft))
            (mapc #'usocket:socket-close (remove nil sockets))))))))

(test websockets.stop-lets-a-running-handler-answer-then-closes-with-1001
  (dolist (soft '(t nil))
    (with-thread-leak-check ()
      (let ((server (websocket-server)))
        (ht:start server)
        (let ((socket (open-websocket server "/slow-echo")))
          (unwind-protect
               (progn
                 (is-true socket)
                 (send-frame socket 1 "late")
                 (is-true (sb-thread:wait-on-semaphore *slow-echo-started* :timeout 10))
                 (ht:stop server :soft soft)
                 (is (equal "late" (read-text socket)) "~:[hard~;soft~] STOP: the handler's answer arrives" soft)
                 (is (eql 1001 (read-close socket)) "~:[hard~;soft~] STOP: then the close frame" soft))
            (when socket (usocket:socket-close socket))))))))

(test websockets.clients-opening-and-closing-leak-nothing
  (with-server (server (websocket-server))
    (let ((threads (length (bt:all-threads))))
      (dotimes (round 100)
        (let ((socket (open-websocket server "/echo")))
          (when socket
            (send-frame socket 1 "hi")
            (read-text socket)
            (send-frame socket 8 (vector 3 232))
            (read-close socket)
            (usocket:socket-close socket))))
      (is (wait-until (lambda () (eql 0 (stats server :open-websockets)))))
      (is (eql 0 (stats server :open-connections)))
      (is (<= (length (bt:all-threads)) (+ threads 2)))
      (is (<= 100 (cdr (assoc 1000 (stats server :websocket-closes)))))
      (is (<= 100 (stats server :websocket-messages-received))))))

;;; TLS.

(test websockets.wss-through-the-engine
  (multiple-value-bind (certificate key) (certificate-files)
    (with-server (server (make-server 'parallel-easy-ssl-acceptor :ssl-certificate-file certificate
                                                                  :ssl-privatekey-file key))
      (let* ((socket (connect server))
             (tls (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)))
        (unwind-protect
             (progn
               (write-sequence (text-octets (websocket-handshake-text "/echo")) tls)
               (finish-output tls)
               (let ((head (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
                 (loop until (search #(13 10 13 10) head)
                       do (vector-push-extend (read-byte tls) head))
                 (is (eql 0 (search "HTTP/1.1 101" (flex:octets-to-string head :external-format :latin-1)))))
               (let ((message (make-string 100000 :initial-element #\w)))
                 (write-sequence (frame 1 (text-octets message)) tls)
                 (finish-output tls)
                 (let ((head (list (read-byte tls) (read-byte tls))))
                   (is (equal '(#x81 127) head))
                   (let* ((length (loop repeat 8 for value = (read-byte tls) then (+ (ash value 8) (read-byte tls))
                                        finally (return value)))
                          (payload (make-array 100000 :element-type '(unsigned-byte 8))))
                     (declare (ignore length))
                     (read-sequence payload tls)
                     (is (equal message (flex:octets-to-string payload :external-format :utf-8)))))))
          (ignore-errors (close tls))
          (usocket:socket-close socket))))))

;;; Hostile clients.

(defun octets-of (&rest parts)
  "The octets of PARTS, strings (as UTF-8) and octet vectors, one after the other."
  (apply #'concatenate '(simple-array (unsigned-byte 8) (*))
         (mapcar (lambda (part) (if (stringp part) (text-octets part) part)) parts)))

(test websockets.frames-sent-with-the-upgrade-request-read-at-once
  (with-server (server (websocket-server))
    (let ((socket (connect server)))
      (unwind-protect
           (progn
             (send-octets socket (octets-of (websocket-handshake-text "/echo") (frame 1 (text-octets "early"))))
             (is (eql 101 (read-reply-head socket)))
             (is (equal "early" (read-text socket :timeout 5)) "echoed with no more octets from the client"))
        (usocket:socket-close socket)))))

(test websockets.upgrade-request-with-a-body-gets-400
  (with-server (server (websocket-server))
    (dolist (header '("Transfer-Encoding: chunked" "Content-Length: 5"))
      (let ((socket (connect server))
            (text (websocket-handshake-text "/echo")))
        (unwind-protect
             (progn
               (send-text socket (concatenate 'string (subseq text 0 (+ 2 (search (crlf-lines "") text)))
                                              (crlf-lines header)
                                              (subseq text (+ 2 (search (crlf-lines "") text)))
                                              (if (search "chunked" header) (crlf-lines "0" "") "hello")))
               (is (eql 400 (read-reply-head socket)) "~A" header))
          (usocket:socket-close socket))))))

(test websockets.idle-client-closed-at-a-timeout-shorter-than-the-ping-interval
  (with-server (server (websocket-server :websocket-timeout 3 :websocket-ping-interval 30))
    (with-websocket (socket server "/echo")
      (is (eql 1001 (read-close socket :timeout 4)) "closed within 4 s, unpinged")
      (is (closed-by-server-p socket)))))

(defun ping-flood (count)
  "COUNT pings in one vector, each carrying its index in two octets."
  (let ((octets (make-array (* count 8) :element-type '(unsigned-byte 8))))
    (dotimes (index count octets)
      (replace octets (frame 9 (vector (ldb (byte 8 8) index) (ldb (byte 8 0) index))) :start1 (* index 8)))))

(test websockets.ping-flood-in-one-write-answered-in-order
  (with-server (server (websocket-server :max-websocket-queue-bytes (* 4 1024 1024)))
    (with-websocket (socket server "/echo")
      (let ((octets-sent-before (stats server :websocket-octets-sent)))
        (send-octets socket (octets-of (ping-flood 80000) (frame 1 (text-octets "after"))))
        (let ((pongs 0) (last nil))
          (loop (multiple-value-bind (opcode payload) (read-frame socket :timeout 30)
                  (case opcode
                    (10 (incf pongs) (setf last payload))
                    (t (is (equal "after" (and (eql opcode 1) (flex:octets-to-string payload :external-format :utf-8))))
                       (return)))))
          (is (= 80000 pongs) "every ping answered, in order")
          (is (equalp #(#x38 #x7f) last) "the last pong answers the last ping (79999)")
          ;; Counted once the send has returned, which may be after the
          ;; client has read the octets.
          (is (wait-until (lambda () (= (+ (* 80000 4) 7) (- (stats server :websocket-octets-sent) octets-sent-before))))
              "~D octets counted sent" (- (stats server :websocket-octets-sent) octets-sent-before)))))))

(test websockets.ping-flooder-that-reads-nothing-closed-with-1008
  (with-server (server (websocket-server :write-timeout 2 :read-timeout 2))
    (with-websocket (socket server "/echo")
      (let* ((pings (apply #'octets-of (loop repeat 500 collect (frame 9 (make-array 125 :element-type '(unsigned-byte 8)
                                                                                       :initial-element 1)))))
             ;; Blocks once the server stops reading; ends when it closes.
             (writer (in-thread (lambda ()
                                  (handler-case (loop repeat 2000 do (send-octets socket pings))
                                    (error () :closed))))))
        (is (wait-until (lambda () (eql 1 (cdr (assoc 1008 (stats server :websocket-closes))))) :timeout 20)
            "closed with 1008 as a client that reads nothing")
        (is (equal '(:closed) (funcall writer)) "the server closed the connection")))))

(test websockets.clients-come-and-go-without-work-that-grows-with-their-number
  (let* ((resource (make-instance 'ws:websocket-resource))
         (clients (loop repeat 10000 collect (make-instance 'ws:websocket-client))))
    (dolist (client clients)
      (hrt::add-resource-client resource client))
    (let ((snapshot (ws:clients resource)))
      (is (equal (reverse clients) snapshot) "newest first")
      (let ((consed (sb-ext:get-bytes-consed)))
        (dolist (client clients)
          (hrt::remove-resource-client resource client))
        (is (< (- (sb-ext:get-bytes-consed) consed) 1000000)
            "10,000 clients went with ~D octets consed (a list copied at each: 800 MB)"
            (- (sb-ext:get-bytes-consed) consed)))
      (is (= 10000 (length snapshot)) "a list taken before is not changed")
      (is (null (ws:clients resource))))))

(defun websocket-without-connection (&key (max-queue-bytes (* 4 1024 1024)))
  "A WEBSOCKET record on no connection, for the functions of its queue."
  (hrt::%make-websocket :set (hrt::%make-readiness-set :counters (hrt::make-connection-counters)
                                                       :memory-budget (hrt::make-memory-budget (* 64 1024 1024)))
                        :max-queue-bytes max-queue-bytes))

(test websockets.a-turn-of-80000-pings-queues-one-piece
  (let ((websocket (websocket-without-connection :max-queue-bytes 330000)))
    (dotimes (index 80000)
      (hrt::note-websocket-ping websocket (make-array 2 :element-type '(unsigned-byte 8)
                                                        :initial-contents (list (ldb (byte 8 8) index)
                                                                                (ldb (byte 8 0) index)))))
    (hrt::queue-websocket-pongs websocket)
    (let ((queue (hrt::websocket-queue websocket)))
      (is (= 1 (length queue)) "one piece, so one send(2), for the turn's 80,000 pongs: ~D" (length queue))
      (let ((octets (hrt::piece-octets (first queue))))
        (is (= 320000 (length octets)))
        (is (equalp #(#x8a 2 0 0 #x8a 2 0 1) (subseq octets 0 8)) "in the order of the pings")
        (is (equalp #(#x8a 2 #x38 #x7f) (subseq octets (- (length octets) 4))))))
    (is (= 320000 (hrt::websocket-unsent-octets websocket)))
    (dotimes (index 100)
      (hrt::note-websocket-ping websocket (make-array 125 :element-type '(unsigned-byte 8))))
    (hrt::queue-websocket-pongs websocket)
    (is (= 1 (length (hrt::websocket-queue websocket)))
        "pongs past :max-websocket-queue-bytes are refused, not queued")
    (is (eql 1008 (hrt::websocket-refusal-code websocket)))))
